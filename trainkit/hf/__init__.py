"""Hugging Face GPT-2: its weights read as ours (the folder checked first), and an export folder with its tokenizer files."""
