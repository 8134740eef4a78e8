"""The tokens: GPT-2's tokenizer, the documents fineweb.py tokenizes, the shard format with its writer, its checks and start-up's scans."""
