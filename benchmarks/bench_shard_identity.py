"""Seconds to fingerprint one token shard for the ranks' start-up check (not a test): a full
sha256 of the file against shards.sampled_sha256 (its size and 16 slices of 64 KiB).

    python benchmarks/bench_shard_identity.py                        # a 100M-token shard (200 MB) in /tmp
    python benchmarks/bench_shard_identity.py --tokens 10M --dir /scratch

Every rank fingerprints every shard of --data-dir at start-up (FineWeb-Edu 10B: 100 shards), so
the cost that counts is a cold read: the shard's pages are dropped from the page cache
(posix_fadvise DONTNEED) before each cold round. The variants run interleaved, --rounds times;
the best round counts.
"""

import hashlib
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402
from fineweb import parse_size  # noqa: E402
from trainkit.data.shards import sampled_sha256  # noqa: E402


def full_sha256(path: str, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def drop_from_page_cache(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=parse_size, default=10**8, help="tokens in the shard (default 100M)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the temporary shard")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="rounds of each variant")
    args = p.parse_args(argv)
    fd, path = tempfile.mkstemp(suffix=".npy", dir=args.dir)
    os.close(fd)
    try:
        np.save(path, np.random.default_rng(0).integers(0, 50257, args.tokens, dtype=np.uint16))
        size = os.path.getsize(path)
        best = {}
        for _ in range(args.rounds):
            for name, fingerprint in (("full sha256", full_sha256), ("sampled", sampled_sha256)):
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        drop_from_page_cache(path)
                    start = time.perf_counter()
                    fingerprint(path, size)
                    seconds = time.perf_counter() - start
                    best[name, cache] = min(best.get((name, cache), seconds), seconds)
        print(f"shard of {args.tokens:,} tokens ({size / 1e6:.0f} MB) in {args.dir}; best of {args.rounds}")
        for cache in ("cold", "warm"):
            full, sampled = best["full sha256", cache], best["sampled", cache]
            print(
                f"{cache:>5}: full sha256 {full * 1e3:9.1f} ms   sampled {sampled * 1e3:7.2f} ms   "
                f"ratio {full / sampled:8.0f}x"
            )
    finally:
        os.remove(path)


if __name__ == "__main__":
    main()
