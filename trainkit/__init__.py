"""trainkit: the modules that keep runs alive, imported by the scripts at the repository's root
(train_gpt2.py, fineweb.py, hellaswag.py, hf_interop.py, sample.py, plot_log.py); none of them
imports a script. Each module says at its top what it defines. Nothing runs at import."""
