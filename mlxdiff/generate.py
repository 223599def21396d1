"""python -m mlxdiff.generate --model M --prompt P [...] --output out.png"""

import argparse
import sys
import time

from .cli import parse_quantize
from .errors import MlxdiffError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlxdiff.generate", description=__doc__)
    p.add_argument("--model", help="pipeline folder, hub id in the local HF cache, or single file "
                                    "(default: the embedded default model under weights/)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transformer", help="a file that replaces the denoiser (safetensors or GGUF)")
    p.add_argument("--skip-guidance-layers", default=None, help="SD3.5: comma-separated layer indices, e.g. 7,8,9")
    p.add_argument("--quantize", default=None,
                   help="quantize while loading: bits for all (e.g. 4) or per component "
                        "(e.g. transformer=4,text_encoder_3=8)")
    p.add_argument("--matmul", choices=("qmm", "dequantize"), default=None,
                   help="how quantized layers multiply (default per backend; see bench/RESULTS.md)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="cap MLX memory; a phase whose weights cannot fit stops before loading")
    p.add_argument("--report-memory", action="store_true", help="print the per-phase memory table")
    p.add_argument("--dtype", default=None, help="compute dtype: float32 (CPU default), bfloat16, float16")
    p.add_argument("--output", default="out.png")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from .pipelines.images import check_writable, save_png
        output = check_writable(args.output)
        import mlxdiff
        if args.memory_limit is not None:
            from .memory import set_memory_limit
            set_memory_limit(args.memory_limit)
        model, prompt = args.model, args.prompt
        if model is None:
            from . import default_model
            model = default_model.folder()
            prompt = default_model.PROMPT if prompt is None else prompt
            print(f"mlxdiff: using the embedded default model {model}")
            print(f"mlxdiff: {default_model.NOTICE}")
            print(f"mlxdiff: prompt: {prompt}")
        prompt = prompt if prompt is not None else "a red circle on a blue background"
        t0 = time.perf_counter()
        pipe = mlxdiff.load(model, transformer=args.transformer, dtype=args.dtype,
                            quantize=parse_quantize(args.quantize), matmul=args.matmul)
        kwargs = dict(negative_prompt=args.negative_prompt, width=args.width, height=args.height, seed=args.seed,
                      progress_bar=not args.no_progress)
        defaults = pipe.defaults()
        kwargs["steps"] = args.steps or defaults["steps"]
        kwargs["guidance"] = args.guidance if args.guidance is not None else defaults["guidance"]
        if args.skip_guidance_layers:
            try:
                kwargs["skip_guidance_layers"] = [int(x) for x in args.skip_guidance_layers.split(",")]
            except ValueError:
                raise MlxdiffError(f"--skip-guidance-layers {args.skip_guidance_layers!r}: expected e.g. 7,8,9") from None
        result = pipe.generate(prompt, **kwargs)
        params = {"prompt": prompt, "negative_prompt": args.negative_prompt or "", "model": str(model),
                  "transformer": args.transformer or "", "width": result.image.width, "height": result.image.height,
                  "steps": kwargs["steps"], "guidance": kwargs["guidance"], "seed": args.seed,
                  "dtype": str(pipe.dtype).replace("mlx.core.", ""), "generator": "mlxdiff"}
        save_png(result.image, output, params)
        print(result.memory_report() if args.report_memory else result.summary())
        print(f"mlxdiff: total {time.perf_counter() - t0:.1f} s; image written to {output.resolve()}")
        return 0
    except MlxdiffError as e:
        print(f"mlxdiff: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlxdiff: interrupted; no image written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
