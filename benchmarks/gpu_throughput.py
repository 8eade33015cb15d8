"""GPU throughput: tokens/s of `finetune train` on a Llama-3.2-1B-shaped model, configuration by configuration,
and TRL's SFTTrainer on the same model and data when `trl` imports.

    python3 benchmarks/gpu_throughput.py [--model DIR] [--steps 30] [--seq 2048] [--micro 4] [--data lognormal]
                                         [--rows default,per-doc,...] [--long] [--8b] [--smoke] [--list] [--logs DIR]

Every row is the quickstart recipe with the model swapped: bf16, packed rows of --seq tokens, loss `auto` (chunked),
AdamW, micro-batch --micro, no accumulation, no eval; a row changes one thing:

  default       attn auto: packed rows through torch's varlen_attn (the documents' cu_seqlens found once per
                micro-batch on the CPU), one device read per step
  per-doc       FINETUNE_PACKED_ATTENTION=sdpa: sdpa one document at a time (auto's kernel before issue 13)
  flex          FINETUNE_PACKED_ATTENTION=flex: flex_attention with one document BlockMask per micro-batch
  sdpa-mask     model.attn_implementation=sdpa: transformers' block-diagonal mask over the whole row
  micro8        default at micro-batch 2 x --micro: with `default`, the fixed per-step overhead
  padded16      data.packing=false, micro-batch 16
  lora          adapter.type=lora (rank 16, all linear layers)
  liger-loss    loss.impl=liger: Liger's fused linear cross-entropy instead of chunked (auto's loss until issue 23)
  liger         model.liger_kernels=true: Liger's fused RMSNorm and SwiGLU (opt-in, unmeasured so far)
  compile       train.compile=true: each decoder layer compiled, the packed attention left out (opt-in,
                unmeasured so far; its first step holds the compilation)
  liger+compile both
  trl-padded, trl-bfd, trl-wrapped   TRL's SFTTrainer (bf16, Liger when installed, sdpa): padded micro 16, bfd
                padding-free packing (isolated), wrapped packing (documents attend to each other); only when `trl`
                imports (`bash scripts/prepare_gpu.sh --trl` carries it)
--long adds `long` and `long-sdpa-mask`: packed rows of 16384 tokens, micro 1, gradient checkpointing, default vs
sdpa-mask. --8b adds the one-GPU adapter rows on a Llama-3.1-8B-shaped random model (written once to /tmp/llama8b,
16 GB), each with gradient checkpointing (non-reentrant), packed rows of --seq, micro --micro:
  lora8b        adapter.type=lora, rank 16, alpha 32, all linear layers, bf16 base
  qlora8b       adapter.type=qlora: the same on an NF4 base (double quantization, bf16 compute)
  trl-lora8b, trl-qlora8b   TRL's SFTTrainer with wrapped packing and Liger, PEFT's LoraConfig of the same rank,
                alpha and targets, BitsAndBytesConfig of the same NF4 settings for QLoRA; TRL's peak memory is the
                largest of the load's and every step's (Trainer.train() resets the statistics when it starts).
                MFU counts the parameters as torch holds them on both sides (a 4-bit packed weight counts half):
                compare these rows by tokens/s and peak memory. --data lognormal (default): chat rows whose lengths follow a lognormal with median ~100 tokens, long
tail to 2048 (benchmarks/packing.py's generator); quickstart: examples/data/quickstart_train.jsonl.

The model is --model, or a random Llama-3.2-1B-shaped one (vocab 128256, tied embeddings) written by
make_llama1b.py (from .gpu/ or ../shared/gpu/) into /tmp/llama1b: tokens/s do not depend on the weights' values.
Each row prints the median over the steps after the first two (warm-up) of real tokens/s, MFU where the GPU is
known, peak memory, and the first step's seconds (compilation, if any, is there); then one table, with the fixed
per-step overhead (2 x step time at --micro - step time at 2 x --micro). --smoke: the `default` row on 2 layers,
6 steps of 1024 tokens, to check the path in about a minute (its figures are not the 1B's). Without CUDA it says
so and exits 1: these are GPU figures. `--print-overrides` and `--list` need no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "yaml" / "quickstart.yaml"
QUICKSTART_DATA = ROOT / "examples" / "data" / "quickstart_train.jsonl"
MAKERS = (ROOT / ".gpu" / "make_llama1b.py", ROOT.parent / "shared" / "gpu" / "make_llama1b.py")
WARMUP_STEPS = 2
KERNEL_ENV = "FINETUNE_PACKED_ATTENTION"
# name -> (recipe overrides, environment, micro-batch multiplier or fixed micro-batch as a negative number)
ROWS: dict[str, tuple[list[str], dict[str, str], int]] = {
    "default": ([], {}, 1),
    "per-doc": ([], {KERNEL_ENV: "sdpa"}, 1),
    "flex": ([], {KERNEL_ENV: "flex"}, 1),
    "sdpa-mask": (["model.attn_implementation=sdpa"], {}, 1),
    "micro8": ([], {}, 2),
    "padded16": (["data.packing=false"], {}, -16),
    "lora": (["adapter.type=lora", "adapter.r=16", "adapter.alpha=32"], {}, 1),
    "liger-loss": (["loss.impl=liger"], {}, 1),
    "liger": (["model.liger_kernels=true"], {}, 1),
    "compile": (["train.compile=true"], {}, 1),
    "liger+compile": (["model.liger_kernels=true", "train.compile=true"], {}, 1),
}
LONG_ROWS = {"long": (["model.gradient_checkpointing=true"], {}, -1),
             "long-sdpa-mask": (["model.gradient_checkpointing=true", "model.attn_implementation=sdpa"], {}, -1)}
TRL_ROWS = {"trl-padded": "padded", "trl-bfd": "bfd", "trl-wrapped": "wrapped"}
# The 8B adapter rows: ours (recipe overrides) and TRL's (the adapter its worker sets up), gradient checkpointing on.
ADAPTER = ["adapter.r=16", "adapter.alpha=32", "adapter.target_modules=all-linear", "model.gradient_checkpointing=true"]
EIGHT_B_ROWS = {"lora8b": (["adapter.type=lora", *ADAPTER], {}, 1), "qlora8b": (["adapter.type=qlora", *ADAPTER], {}, 1)}
TRL_8B_ROWS = {"trl-lora8b": "lora", "trl-qlora8b": "qlora"}
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
ALL_ROWS = (*ROWS, *LONG_ROWS, *EIGHT_B_ROWS, *TRL_ROWS, *TRL_8B_ROWS)


def overrides(model: str, steps: int, seq: int, micro: int, out: str) -> list[str]:
    """The quickstart recipe turned into the benchmark's: the model from `model`, bf16, no eval."""
    return [f"output_dir={out}", f"model.path={model}", "model.init=pretrained", "model.config=null",
            "model.dtype=bfloat16", f"data.max_seq_len={seq}", f"train.micro_batch_size={micro}",
            "train.gradient_accumulation_steps=1", f"train.max_steps={steps}", "train.epochs=null",
            "train.warmup_steps=0", "eval.at_start=false", "eval.every_steps=null", "logging.every_steps=1"]


def summarize(metrics: Path) -> dict[str, float]:
    """Medians over the train lines after the warm-up steps of metrics.jsonl."""
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [r for r in lines if "loss" in r]
    timed = steps[WARMUP_STEPS:] or steps
    out = {"steps": float(len(steps)), "last_loss": float(steps[-1]["loss"]) if steps else float("nan")}
    for key in ("tokens_per_s", "padded_tokens_per_s", "mfu", "peak_memory_mb"):
        values = [float(r[key]) for r in timed if r.get(key) is not None]
        out[key] = statistics.median(values) if values else float("nan")
    first = steps[0] if steps else {}
    out["first_step_s"] = (first["seq_tokens"] / first["tokens_per_s"] if first.get("tokens_per_s")
                           and "seq_tokens" in first else float("nan"))
    return out


def model_dir(given: str | None, smoke: bool) -> str:
    """--model, else a Llama-1B-shaped random model made once by make_llama1b.py (2 layers for --smoke)."""
    if given:
        return given
    target = Path("/tmp/llama1b-2layers" if smoke else "/tmp/llama1b")
    if (target / "config.json").is_file():
        return str(target)
    maker = next((m for m in MAKERS if m.is_file()), None)
    if maker is None:
        raise SystemExit(f"no --model and no make_llama1b.py at {' or '.join(map(str, MAKERS))}: "
                         "run `bash scripts/prepare_gpu.sh`, or pass --model DIR")
    subprocess.run([sys.executable, str(maker), str(target), *(["--layers", "2"] if smoke else [])], check=True)
    return str(target)


def model_dir_8b(smoke: bool) -> str:
    """A Llama-3.1-8B-shaped random model (bf16, made on the GPU when there is one), written once; 2 layers with
    --smoke."""
    import torch
    import transformers

    target = Path("/tmp/llama8b-2layers" if smoke else "/tmp/llama8b")
    if not (target / "config.json").is_file():
        config = transformers.LlamaConfig(**{**LLAMA_8B, **({"num_hidden_layers": 2} if smoke else {})})
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: 16 GB, not 32 in float32 first
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = transformers.LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
        model.save_pretrained(target)
        del model
    return str(target)


def data_file(kind: str) -> Path:
    """The training rows: the quickstart's, or lognormal chat rows (median ~100 tokens) made once in /tmp."""
    if kind == "quickstart":
        return QUICKSTART_DATA
    path = Path(tempfile.gettempdir()) / "finetune-gpu-throughput" / "lognormal-100.jsonl"
    if not path.is_file():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from packing import synthesize_lognormal

        path.parent.mkdir(parents=True, exist_ok=True)
        synthesize_lognormal(path.with_suffix(".tmp"), 6000, median=100.0).rename(path)
    return path


def row_command(name: str, a: argparse.Namespace, model: str, data: Path, out: str) -> tuple[list[str], dict]:
    """The `finetune train` command line and environment of one row."""
    extra, env, micro = {**ROWS, **LONG_ROWS, **EIGHT_B_ROWS}[name]
    seq = 16384 if name in LONG_ROWS else a.seq
    micro = -micro if micro < 0 else micro * a.micro
    args = [*overrides(model, a.steps, seq, micro, out), f"datasets.0.path={data}", *extra]
    return [sys.executable, "-m", "finetune", "train", str(QUICKSTART), *args], {**os.environ, **env}


def run_ours(name: str, a: argparse.Namespace, model: str, data: Path) -> dict[str, float] | str:
    """One row's figures, or why it failed (its last lines)."""
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        cmd, env = row_command(name, a, model, data, str(Path(tmp) / "run"))
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        keep_log(a, name, done)
        if done.returncode != 0:
            return f"exit {done.returncode}: " + " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        return summarize(Path(tmp) / "run" / "metrics.jsonl")


def keep_log(a: argparse.Namespace, name: str, done: subprocess.CompletedProcess) -> None:
    """The row's whole output in --logs DIR/NAME.log: a failure on a lent GPU machine must be readable afterwards."""
    if a.logs:
        Path(a.logs).mkdir(parents=True, exist_ok=True)
        (Path(a.logs) / f"{name}.log").write_text(f"{done.stdout}\n--- stderr ---\n{done.stderr}")


# --- TRL -------------------------------------------------------------------------------------------------------

def trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def run_trl(name: str, a: argparse.Namespace, model: str, data: Path) -> dict[str, float] | str:
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-trl-") as tmp:
        out = Path(tmp) / "laps.json"
        mode = TRL_ROWS.get(name, "wrapped")
        micro = 16 if mode == "padded" else a.micro
        adapter = ["--adapter", TRL_8B_ROWS[name], "--checkpointing"] if name in TRL_8B_ROWS else []
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", mode, "--model", model,
               "--data-file", str(data), "--seq", str(a.seq), "--micro", str(micro), "--steps", str(a.steps),
               "--out", str(out), *adapter]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        keep_log(a, name, done)
        if done.returncode != 0:
            return f"exit {done.returncode}: " + " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        result = json.loads(out.read_text())
    laps = [(real, seconds, computed) for (real, seconds), computed in zip(result["laps"], result["computed"])]
    timed = laps[WARMUP_STEPS:] or laps
    figures = {"steps": float(len(laps)), "peak_memory_mb": result["peak_memory_mb"],
               "tokens_per_s": statistics.median(real / seconds for real, seconds, _ in timed),
               "padded_tokens_per_s": statistics.median(computed / seconds for _, seconds, computed in timed),
               "first_step_s": laps[0][1], "last_loss": float("nan")}
    figures["mfu"] = _mfu(figures["tokens_per_s"], result["params"], result["layers"], result["hidden"], a.seq)
    return figures


def _mfu(tokens_per_s: float, params: int, layers: int, hidden: int, seq: int) -> float:
    import torch

    sys.path.insert(0, str(ROOT))
    from finetune.metrics import mfu

    value = mfu(tokens_per_s, params, layers, hidden, seq, torch.device("cuda"))
    return value if value is not None else float("nan")


def trl_worker(a: argparse.Namespace) -> None:
    """Runs SFTTrainer on the model and data (bf16, Liger when it imports, sdpa), timing every optimizer step with
    a device synchronization, counting real and computed tokens per step."""
    import importlib.util

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()  # the rows are GPU figures; a CPU only smoke-tests this worker
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples" / "tokenizer"))
    quantized = {}
    if a.adapter == "qlora":  # our NF4 settings (finetune/model/loading.py _nf4_config)
        from transformers import BitsAndBytesConfig

        quantized["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if cuda else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa", **quantized)
    model.config.use_cache = False
    peft_config = None
    if a.adapter:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    loaded_peak = torch.cuda.max_memory_allocated() if cuda else 0  # train() resets the statistics
    step_peaks: list[int] = []
    laps: list[tuple[int, float]] = []
    computed: list[int] = []
    counted = {"real": 0, "computed": 0}

    class Timed(SFTTrainer):
        def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> Any:
            mask = inputs.get("attention_mask")
            counted["real"] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            counted["computed"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        last = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if not laps and not Clock.last:
                sync()
                Clock.last = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            sync()
            now = time.perf_counter()
            step_peaks.append(torch.cuda.max_memory_allocated() if cuda else 0)
            laps.append((counted["real"], now - Clock.last))
            computed.append(counted["computed"])
            counted.update(real=0, computed=0)
            Clock.last = now

    packed = a.trl_worker != "padded"
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=1, max_length=a.seq, packing=packed,
        **({"packing_strategy": a.trl_worker} if packed else {}), padding_free=a.trl_worker == "bfd",
        assistant_only_loss=True, learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=10_000,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, bf16=cuda, use_cpu=not cuda,
        dataloader_num_workers=0, use_liger_kernel=cuda and importlib.util.find_spec("liger_kernel") is not None,
        gradient_checkpointing=a.checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = Timed(model=model, args=config, train_dataset=load_dataset("json", data_files=a.data_file, split="train"),
                    processing_class=tokenizer, callbacks=[Clock()], peft_config=peft_config)
    trainer.train()
    text = model.config.get_text_config()
    Path(a.out).write_text(json.dumps({
        "laps": laps, "computed": computed, "peak_memory_mb": max([loaded_peak, *step_peaks]) / 2**20,
        "params": sum(p.numel() for p in model.parameters()), "layers": text.num_hidden_layers,
        "hidden": text.hidden_size}))


# --- report ----------------------------------------------------------------------------------------------------

def print_table(results: dict[str, dict[str, float] | str], a: argparse.Namespace) -> None:
    wrapped = results.get("trl-wrapped")
    print("\n| run | real tok/s | MFU | peak MiB | first step s | vs TRL wrapped |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"| {name} | failed: {r[:120]} | | | | |")
            continue
        ratio = (f"{r['tokens_per_s'] / wrapped['tokens_per_s']:.2f}x" if isinstance(wrapped, dict) else "-")
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.3f} | {r['peak_memory_mb']:,.0f} | "
              f"{r['first_step_s']:.1f} | {ratio} |")
    four, eight = results.get("default"), results.get("micro8")
    if isinstance(four, dict) and isinstance(eight, dict):
        t4 = a.micro * a.seq / four["padded_tokens_per_s"]
        t8 = 2 * a.micro * a.seq / eight["padded_tokens_per_s"]
        print(f"\nfixed per-step overhead (2 x {t4 * 1e3:.1f} ms at micro {a.micro} - {t8 * 1e3:.1f} ms at micro "
              f"{2 * a.micro}): {(2 * t4 - t8) * 1e3:.1f} ms")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model directory (default: a Llama-1B-shaped random model in /tmp)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--data", choices=["lognormal", "quickstart"], default="lognormal")
    p.add_argument("--rows", help=f"comma-separated rows of {', '.join(ALL_ROWS)}")
    p.add_argument("--long", action="store_true", help="add the rows of 16384-token packed rows")
    p.add_argument("--smoke", action="store_true", help="the default row, 2 layers, 6 steps of 1024 tokens")
    p.add_argument("--logs", help="write each row's whole output to LOGS/ROW.log")
    p.add_argument("--list", action="store_true", help="print each row's command and exit (no GPU needed)")
    p.add_argument("--print-overrides", action="store_true", help="print the recipe overrides and exit")
    p.add_argument("--8b", dest="eight_b", action="store_true", help="add the 8B LoRA and QLoRA rows, ours and TRL's")
    p.add_argument("--trl-worker", choices=sorted(set(TRL_ROWS.values())), help=argparse.SUPPRESS)
    p.add_argument("--adapter", choices=["lora", "qlora"], help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.seq = 6, 1024
    default_rows = ["default"] if a.smoke else [*ROWS, *(LONG_ROWS if a.long else {}),
                                                *(EIGHT_B_ROWS if a.eight_b else {}),
                                                *(TRL_ROWS if trl_version() else {}),
                                                *(TRL_8B_ROWS if trl_version() and a.eight_b else {})]
    a.row_names = [r.strip() for r in a.rows.split(",")] if a.rows else default_rows
    unknown = set(a.row_names) - set(ALL_ROWS)
    if unknown:
        p.error(f"unknown rows {', '.join(sorted(unknown))}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.trl_worker:
        trl_worker(a)
        return 0
    if a.print_overrides:
        print(" ".join(overrides(a.model or "/tmp/llama1b", a.steps, a.seq, a.micro, "runs/gpu-throughput")))
        return 0
    if a.list:
        for name in a.row_names:
            if name in TRL_ROWS or name in TRL_8B_ROWS:
                adapter = f", {TRL_8B_ROWS[name]}, gradient checkpointing" if name in TRL_8B_ROWS else ""
                print(f"{name}: TRL SFTTrainer, {TRL_ROWS.get(name, 'wrapped')}{adapter}")
                continue
            default = "/tmp/llama8b" if name in EIGHT_B_ROWS else "/tmp/llama1b"
            cmd, env = row_command(name, a, a.model or default, Path(f"<{a.data} data>"), "<tmp>")
            extra_env = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"{name}: {' '.join(f'{k}={v}' for k, v in extra_env.items())} {' '.join(cmd[2:])}".strip())
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_throughput: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              "nothing measured")
        return 1
    model, data = model_dir(a.model, a.smoke), data_file("quickstart" if a.smoke else a.data)
    mode = "smoke (2 layers)" if a.smoke else "Llama-1B-shaped"
    print(f"gpu_throughput: {torch.cuda.get_device_name()} | torch {torch.__version__} | {mode} bf16, rows of "
          f"{a.seq}, micro {a.micro}, {a.steps} steps, {a.data} data; TRL {trl_version() or 'not installed'}",
          flush=True)
    results: dict[str, dict[str, float] | str] = {}
    for name in a.row_names:
        eight_b = name in EIGHT_B_ROWS or name in TRL_8B_ROWS
        on = (a.model or model_dir_8b(a.smoke)) if eight_b else model
        trl = name in TRL_ROWS or name in TRL_8B_ROWS
        results[name] = run_trl(name, a, on, data) if trl else run_ours(name, a, on, data)
        r = results[name]
        print(f"  {name}: {r}" if isinstance(r, str) else
              f"  {name}: {r['tokens_per_s']:,.0f} tokens/s real, {r['padded_tokens_per_s']:,.0f} computed, MFU "
              f"{r['mfu']:.3f}, peak {r['peak_memory_mb']:,.0f} MiB, first step {r['first_step_s']:.1f} s",
              flush=True)
    print_table(results, a)
    first = results[a.row_names[0]]
    if isinstance(first, str):
        print(f"gpu_throughput: the run failed ({first})")
        return 1
    print(f"gpu_throughput: {torch.cuda.get_device_name()} | {mode} bf16, packed rows of {a.seq}, micro {a.micro}, "
          f"{int(first['steps'])} steps (median of steps after {WARMUP_STEPS}), {a.row_names[0]}: "
          f"{first['tokens_per_s']:,.0f} tokens/s real, {first['padded_tokens_per_s']:,.0f} computed, "
          f"MFU {first['mfu']:.3f}, peak {first['peak_memory_mb']:,.0f} MiB, last loss {first['last_loss']:.3f}")
    return 0 if all(isinstance(r, dict) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
