"""Models and their loading: local files in the dtype a role's spec says (:mod:`~lmppo.modeling.loading`),
quantized and offloaded frozen models (:mod:`~lmppo.modeling.quantize`), LoRA (:mod:`~lmppo.modeling.lora`),
the value model and what is done to any model (:mod:`~lmppo.modeling.models`), and data parallelism: DDP,
FSDP2 sharding and the few collectives (:mod:`~lmppo.modeling.distributed`).

May import: the basics, :mod:`lmppo.math`, :mod:`lmppo.inputs`."""
