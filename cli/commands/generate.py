"""`switchyard generate`: one prompt through the engine, offline, streamed to stdout."""

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate text with the engine, offline")
    gen.add_argument("prompt")
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams
    from workers.errors import EngineError

    try:
        # One prompt: size the KV cache and decode workspace for a handful of sequences.
        config = EngineConfig(
            dtype=args.dtype, device=args.device, scheduler=SchedulerConfig(max_num_seqs=4)
        )
        engine = LLMEngine.from_pretrained(args.model, config)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
        )
        prompt = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                print(f"error: {args.model} has no tokenizer for --chat", file=sys.stderr)
                return 2
            prompt = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
        # A rendered chat prompt holds its special tokens already.
        req = engine.add_request(prompt=prompt, params=params, add_special_tokens=not args.chat)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    print()
    print(
        f"[{req.num_output_tokens} tokens, finish_reason={req.finish_reason}]",
        file=sys.stderr,
    )
    return 0
