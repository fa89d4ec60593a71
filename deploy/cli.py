"""`dflash-serve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt, in process")
    g.add_argument("--model", required=True, help="target checkpoint directory")
    g.add_argument("--draft-model",
                   help="DFlash draft checkpoint directory (omit for plain decoding)")
    g.add_argument("--speculative-dflash-block-size", type=int, dest="block_size",
                   help="verify block size B (proposes B-1 tokens); default: the draft's")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (tokenised with the target's tokenizer)")
    src.add_argument("--prompt-ids", type=_parse_ids, help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def generate(args: argparse.Namespace) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig, SamplingParams
    from deploy.tokenizer import load_tokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    cfg = EngineConfig(model=args.model, draft_model=args.draft_model, block_size=args.block_size,
                       device=args.device, dtype=args.dtype, max_num_seqs=1)
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer; pass --prompt-ids instead")
        if args.chat:
            prompt_ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        prompt_ids = args.prompt_ids
    engine = LLMEngine(cfg)
    start = time.perf_counter()
    out = engine.generate([list(prompt_ids)], params)[0]
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True) if tokenizer else None
    return {
        "token_ids": out.output_ids,
        "text": text,
        "finish_reason": out.finish_reason,
        "acceptance_lengths": out.acceptance_lengths,
        "num_rounds": len(out.acceptance_lengths),
        "mean_acceptance_length": (
            sum(out.acceptance_lengths) / len(out.acceptance_lengths)
            if out.acceptance_lengths else 0.0
        ),
        "elapsed_s": round(elapsed, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            result = generate(args)
            if args.json:
                print(json.dumps(result))
            else:
                print(result["text"] if result["text"] is not None else result["token_ids"])
                print(f"[{len(result['token_ids'])} tokens, {result['num_rounds']} rounds, "
                      f"mean acceptance {result['mean_acceptance_length']:.2f}, "
                      f"{result['elapsed_s']:.2f} s]", file=sys.stderr)
    except ValueError as e:
        print(f"dflash-serve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
