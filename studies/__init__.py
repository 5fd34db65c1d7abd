"""Studies: experiments that reproduce the paper's claims, with figures, the report and the command line.

contract.py       what a study is (grid, run, claims, figures); the registry
context.py        RunContext: the run's parameters, built once by the command line
experiments/      the studies, one module each
report.py         run the studies, write config.json, summary.json, report.md
cli.py            the ``meanfield`` command
grid.py           a study's grid through the sweep runner
sweep/            the resumable sweep runner (self-contained)
io.py             atomic CSV / JSON / PNG files
common.py         helpers several studies share (seeded matrices, log-log fits)
plotting.py       the figures' style
models.py         BERT and GPT-2 checkpoints, the corpus and the tokenizer (layers as operators: meanfield.hf)
"""
