"""trainkit: the library the scripts at the repository's root import (train_gpt2.py, fineweb.py,
hellaswag.py, hf_interop.py, sample.py, plot_log.py), arranged by concern: cli.py (errors and printing),
fileio.py (reading and writing files), train_flags.py (the trainer's flags), then data/, runtime/,
runfiles/, evaluation/ and hf/; a module imports only what comes before it in that order, and none
imports a script. Nothing runs at import: this package re-exports nothing.
"""
