"""HellaSwag (its file, its examples, its scoring) and sampling, shared by hellaswag.py, sample.py and the trainer's in-training evaluations."""
