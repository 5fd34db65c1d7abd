"""Studies: experiments that reproduce the paper's claims, with figures, the report and the command line.

contract.py       what a study is (grid, run, claims, figures); the registry
context.py        RunContext: the run's parameters, built once by the command line
experiments/      the studies, one module each
report.py         run the studies, write config.json, summary.json, report.md
cli.py            the ``meanfield`` command
bracket.py        ``meanfield bracket``: a certified bracket on Lip(f on B_R^n) for one layer of your model
grid.py           a study's grid through the sweep runner
sweep/            the resumable sweep runner (self-contained)
io.py             atomic CSV / JSON / PNG files
common.py         helpers several studies share (seeded matrices, log-log fits)
plotting.py       the figures' style
models.py         BERT and GPT-2 checkpoints, the corpus and the tokenizer (layers as operators: meanfield.hf)
"""

def _require_own_meanfield() -> None:
    # ``meanfield`` is also the name of an unrelated PyPI package; a foreign one shadowing this
    # project's gets an ImportError that says so (meanfield checks particles and transport itself)
    import importlib

    try:
        module = importlib.import_module("meanfield")
    except ImportError:
        raise
    except Exception as exc:
        raise ImportError(f"meanfield: importing it failed ({type(exc).__name__}: {exc}); if it is not "
                          "smooth-attention's own package, install smooth-attention in its own virtual "
                          "environment") from exc
    if getattr(module, "__smooth_attention__", None) != "smooth-attention":
        raise ImportError(f"meanfield: the module Python imports as 'meanfield' ({getattr(module, '__file__', '?')}) "
                          "is not smooth-attention's own: an unrelated package of the same name shadows it. Install "
                          "smooth-attention in its own virtual environment, or pip uninstall the other package",
                          name="meanfield")


_require_own_meanfield()

from particles._version import __version__ as __version__  # noqa: E402

__smooth_attention__ = "smooth-attention"
