"""A run's policy as a Hugging Face checkpoint, for transformers, vLLM or an evaluation harness.

    python -m tbajax.export RUN_DIR [--version N | --checkpoint STEP] [--out DIR] [--dtype bfloat16] [--peft]

Writes config.json, safetensors, the run's tokenizer and its rollout sampling as
generation_config.json (`AutoModelForCausalLM.from_pretrained(DIR)` loads it), from a published
param version (the weights the searchers sample with; the newest `system.keep_param_versions`
are kept) or a trainer checkpoint (the trainer's own params, only those read); by default,
whichever is newer. A LoRA run is exported with its adapters merged into its base checkpoint
(`model.checkpoint`), which is read only then, or with --peft as its adapters alone (a PEFT
adapter directory). The architecture and the tokenizer are the run's own copies (RUN_DIR/model/,
`tbajax.system.run_model`), so a run directory exports on another machine; a run from before
those copies reads them from the base checkpoint.
`export.json` beside the weights records the run, the source and the trainer step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """What was asked for cannot be exported (nothing published, an occupied output directory)."""


@dataclasses.dataclass(frozen=True)
class Exported:
    directory: Path
    source: str  # "param version N" or "trainer checkpoint N"
    step: int | None  # the trainer step of those params
    written: str  # "full" (every weight stored), "lora_merged" (into the base) or "peft_adapters"
    dtype: str


@dataclasses.dataclass(frozen=True)
class StoredPolicy:
    """A run's policy as it stored it at one point (a published version or a trainer checkpoint),
    read back: `trained` is every weight, or a LoRA run's adapters (`adapters`), over `base` (the
    base checkpoint's params when the adapters are to be merged, else its abstract shapes)."""

    config: Any  # the run's ExperimentConfig, its tokenizer read from the run's copy where it has one
    model_config: Any  # its ModelConfig
    graphdef: Any
    base: Any
    trained: Any
    adapters: bool
    source: str  # "param version N" or "trainer checkpoint N"
    version: int | None
    checkpoint: int | None
    step: int | None  # the trainer step of those params

    def model(self) -> Any:
        """The policy as a `CausalLM`: the stored weights, or the adapters merged into the base."""
        import jax
        from flax import nnx

        from tbajax.system.publishing import SearcherParams

        if self.adapters:
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.base)):
                raise ValueError("these adapters were read without their base checkpoint's params "
                                 "(read_stored_policy(merge=False)): read them with merge=True to merge them")
            lora = self.config.model.lora
            state = SearcherParams(self.base, None, lora).merge(self.trained, lora)
        else:
            state = jax.tree.map(lambda x: x, self.base)  # a copy: nnx.replace_by_pure_dict writes in place
            nnx.replace_by_pure_dict(state, self.trained)
        return nnx.merge(self.graphdef, state)


def choose_source(run_dir: str | os.PathLike[str], *, version: int | None = None,
                  checkpoint: int | None = None, store_url: str | None = None
                  ) -> tuple[int | None, int | None, int | None]:
    """(version, checkpoint, trainer step): what to read from the run in `run_dir`: param version
    `version`, or trainer checkpoint `checkpoint`; neither: whichever of the newest version and
    the newest checkpoint is of the later trainer step, the checkpoint on a tie (it holds the
    trainer's own params, a version may be a bf16 copy). A sync-mode run publishes no versions:
    its checkpoints are what it has."""
    from tbajax.stores.params import ParamReader
    from tbajax.stores.urls import param_store_url
    from tbajax.system import rundir

    run_dir = Path(run_dir)
    if version is not None and checkpoint is not None:
        raise ExportError("give a param version or a trainer checkpoint, not both")
    if not (run_dir / "config.json").is_file():
        raise ExportError(f"{run_dir} holds no run (no config.json): pass the --run-dir of a "
                          "`python -m tbajax.main` run")
    store = param_store_url(store_url or str(run_dir))
    reader = ParamReader(store, f"export-{os.getpid()}")
    if version is None and checkpoint is None:
        version, checkpoint = _newest(reader, rundir.checkpoint_steps(run_dir), store, run_dir)
    step = checkpoint if version is None else reader.version_step(version)  # ParamVersionError: which exist
    return version, checkpoint, step


def holds_adapters(config: Any, version: int | None) -> bool:
    """Whether what a run stored is LoRA adapters: a LoRA run's checkpoints always are, its
    versions unless it publishes the merged policy (`system.publish`)."""
    from tbajax.system.publishing import publishes_adapters

    return config.model.lora is not None and (version is None or publishes_adapters(config))


def read_stored_policy(run_dir: str | os.PathLike[str], *, version: int | None = None,
                       checkpoint: int | None = None, store_url: str | None = None,
                       merge: bool = True) -> StoredPolicy:
    """The params the run in `run_dir` stored (see `choose_source` for which), read onto the first
    device. A LoRA run's adapters come with its base checkpoint's params when `merge` (for
    `StoredPolicy.model`); otherwise no weight of the base checkpoint is read. The architecture
    and the tokenizer (`StoredPolicy.config`) are the run's copies in RUN_DIR/model/ where it has
    them (`tbajax.system.run_model`), else the base checkpoint's."""
    from flax import nnx

    from tbajax.models import CheckpointError, ModelConfig, resolve_checkpoint
    from tbajax.models.hf import abstract_model, load_weights
    from tbajax.stores.params import ParamReader
    from tbajax.stores.urls import param_store_url
    from tbajax.system import rundir
    from tbajax.system.publishing import SearcherParams
    from tbajax.system.run_model import architecture_dir, with_run_tokenizer
    from tbajax.training.checkpoint import restore_params

    run_dir = Path(run_dir)
    version, checkpoint, step = choose_source(run_dir, version=version, checkpoint=checkpoint,
                                              store_url=store_url)
    config = with_run_tokenizer(run_dir, rundir.load_config(run_dir))
    spec = config.model
    cfg = ModelConfig.from_hf(json.loads((architecture_dir(run_dir, config) / "config.json").read_text()),
                              param_dtype=spec.param_dtype, dtype=spec.dtype, attention=spec.attention)
    adapters = holds_adapters(config, version)
    if adapters and merge:
        try:
            source = resolve_checkpoint(spec.checkpoint)
        except CheckpointError as e:
            raise ExportError(f"merging this LoRA run's adapters reads its base checkpoint's weights, and "
                              f"model.checkpoint={spec.checkpoint!r} cannot be read ({e}): make it reachable "
                              "at that path, or export the adapters alone with --peft") from None
        base = nnx.state(load_weights(source, cfg), nnx.Param)
        graphdef = nnx.graphdef(abstract_model(cfg))
    else:  # every weight is stored, or the adapters stay apart: the architecture is all it takes
        graphdef, base = nnx.split(abstract_model(cfg))
    what = f"param version {version}" if version is not None else f"trainer checkpoint {checkpoint}"
    log.info("reading %s of %s%s", what, run_dir, " and the base checkpoint" if adapters and merge else "")
    if version is not None:  # a version's manifest says what it holds; `target` checks it against the run
        with ParamReader(param_store_url(store_url or str(run_dir)), f"export-{os.getpid()}") as reader:
            trained, _ = reader.restore_for(version, SearcherParams(base, None, config.model.lora).target)
    else:
        trained, _ = restore_params(run_dir / "checkpoints", checkpoint)
    return StoredPolicy(config, cfg, graphdef, base, trained, adapters, what, version, checkpoint, step)


def export_policy(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None, *,
                  version: int | None = None, checkpoint: int | None = None, dtype: str | None = None,
                  store_url: str | None = None, overwrite: bool = False, peft: bool = False) -> Exported:
    """Write the policy of the run in `run_dir` (`choose_source`) as an HF checkpoint in `out_dir`
    (None: RUN_DIR/hf/version-N or RUN_DIR/hf/checkpoint-N), in `dtype` (None: `model.param_dtype`,
    what the searchers sample with). An existing, non-empty `out_dir` is an error unless
    `overwrite`.

    peft: a LoRA run's adapters alone, as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors, `peft.PeftModel.from_pretrained(base, DIR)`), instead of the
    merged model; the base checkpoint's weights are not read."""
    from flax import nnx

    from tbajax.models import save_model
    from tbajax.models.lora import save_peft_adapter
    from tbajax.system import rundir
    from tbajax.system.assets import load_tokenizer_for

    run_dir = Path(run_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    version, checkpoint, _ = choose_source(run_dir, version=version, checkpoint=checkpoint,
                                           store_url=store_url)
    name = f"version-{version}" if version is not None else f"checkpoint-{checkpoint}"
    out = Path(out_dir) if out_dir is not None else run_dir / "hf" / name
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty: pass another --out, or --overwrite to replace "
                          "its files")
    config = rundir.load_config(run_dir)
    if peft and not holds_adapters(config, version):  # said before anything large is read
        raise ExportError("--peft writes a LoRA run's adapters, and " + (
            "this run trains every weight (model.lora is null)" if config.model.lora is None else
            f"its param versions hold the merged policy (system.publish={config.system.publish!r}): "
            "export a trainer checkpoint (--checkpoint STEP), or the merged model without --peft"))
    stored = read_stored_policy(run_dir, version=version, checkpoint=checkpoint, store_url=store_url,
                                merge=not peft)
    dtype = dtype or config.model.param_dtype
    log.info("writing %s", out)
    if peft:
        save_peft_adapter(out, nnx.merge(stored.graphdef, stored.base), stored.trained, config.model.lora,
                          base_model_name_or_path=config.model.checkpoint)
    else:
        save_model(stored.model(), out, dtype=dtype)
    tokenizer = load_tokenizer_for(stored.config)  # the run's own copy where it has one
    tokenizer.save_pretrained(out)
    generation_config(config, stored.model_config, tokenizer).save_pretrained(out)
    written = "peft_adapters" if peft else "lora_merged" if stored.adapters else "full"
    record = {"run": str(run_dir.resolve()), "run_id": _run_id(run_dir), "experiment": config.name,
              "objective": config.train.objective, "base_checkpoint": config.model.checkpoint,
              "source": stored.source, "version": version, "checkpoint": checkpoint, "step": stored.step,
              "written": written, "dtype": "float32" if peft else dtype,
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return Exported(out, stored.source, stored.step, written, record["dtype"])


def generation_config(config: Any, cfg: Any, tokenizer: Any) -> Any:
    """The run's rollout sampling as transformers' `GenerationConfig`, so `generate` (and vLLM,
    which reads generation_config.json) samples as the searchers did: temperature, top-k / top-p,
    the stop ids and the response cap."""
    from transformers import GenerationConfig

    sampling = config.rollout.sampling
    stops = list(sampling.stop_token_ids if sampling.stop_token_ids is not None else cfg.eos_token_ids)
    pad = sampling.pad_token_id if sampling.pad_token_id is not None else tokenizer.pad_token_id
    drawn = {} if sampling.is_greedy else {  # top_k 0 and top_p 1.0 are "off" here as in tbajax
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    return GenerationConfig(
        do_sample=not sampling.is_greedy, **drawn, max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.min_new_tokens or None, eos_token_id=stops or None, pad_token_id=pad,
        bos_token_id=cfg.bos_token_id,
    )


def _newest(reader: Any, checkpoints: list[int], store: str, run_dir: Path) -> tuple[int | None, int | None]:
    """(version, None) or (None, checkpoint step): the later trainer step, the checkpoint on a tie."""
    latest = reader.latest_version()
    if latest is None and not checkpoints:
        raise ExportError(f"{run_dir} has no params to export yet: no version published to {store} and no "
                          "trainer checkpoint (the trainer publishes at each sync and checkpoints every "
                          "train.checkpoint_every steps)")
    if latest is None:
        return None, checkpoints[-1]
    step = reader.version_step(latest)
    if checkpoints and (step is None or checkpoints[-1] >= step):
        return None, checkpoints[-1]
    return latest, None


def _run_id(run_dir: Path) -> str | None:
    path = run_dir / "run_id"
    return path.read_text().strip() if path.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tbajax.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (--run-dir of python -m tbajax.main)")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--version", type=int, help="a published param version (see RUN_DIR/params)")
    source.add_argument("--checkpoint", type=int, metavar="STEP",
                        help="a trainer checkpoint (see RUN_DIR/checkpoints)")
    ap.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/hf/version-N)")
    ap.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the run's model.param_dtype)")
    ap.add_argument("--store", help="URL of the run's stores where they are not the run dir (main's --store)")
    ap.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    ap.add_argument("--peft", action="store_true",
                    help="a LoRA run: its adapters alone as a PEFT adapter directory, not the merged model")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Reading, merging and writing weights needs no accelerator: on the host, an export takes no
    # memory from the GPUs a run may still be using (JAX would reserve most of one at its first
    # array). JAX_PLATFORMS set by the caller still wins; too late once jax has started (in-process).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tbajax.config import ConfigError
    from tbajax.models import CheckpointError
    from tbajax.stores.params import ParamStoreError, ParamVersionError

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)  # what it reads and writes, on stderr: a 7B model takes a while
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on metadata files it does without
    try:
        done = export_policy(args.run_dir, args.out, version=args.version, checkpoint=args.checkpoint,
                             dtype=args.dtype, store_url=args.store, overwrite=args.overwrite, peft=args.peft)
    except (ExportError, ConfigError, CheckpointError, ParamStoreError, ParamVersionError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    step = "" if done.step is None else f" (trainer step {done.step})"
    how = {"full": "", "lora_merged": ", its LoRA adapters merged into the base checkpoint,",
           "peft_adapters": ", its LoRA adapters as a PEFT adapter,"}[done.written]
    print(f"exported {done.source}{step} of {args.run_dir}{how} in {done.dtype} to {done.directory}")
    if done.written == "peft_adapters":
        print(f"load it with peft.PeftModel.from_pretrained(base_model, {str(done.directory)!r})")
    else:
        print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(done.directory)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
