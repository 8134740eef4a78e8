"""The data of evals/hellaswag_local.yaml: rowanz's hellaswag_val.jsonl from a local file (or
trainkit/evaluation/hellaswag_examples.py's sha256-checked download), handed to lm-eval's own
hellaswag process_docs, so the text the model sees is exactly lm-eval's."""

import json
import os
import sys

import datasets
from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401  (the YAML's process_docs)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for trainkit/
from trainkit.evaluation.hellaswag_examples import resolve_data_file  # noqa: E402

FLAG = "--metadata '{\"data_file\": PATH}' (hf_interop.py eval: --hellaswag-file PATH)"


def load_local(data_file: str | None = None, **_metadata) -> datasets.DatasetDict:
    """{"validation": the records of data_file}, else of $HELLASWAG_DIR/hellaswag_val.jsonl or
    ~/.cache/gpt2-trainer/hellaswag/hellaswag_val.jsonl (downloaded there if missing). lm-eval
    calls it as the task's custom_dataset with the task's metadata (--metadata included)."""
    path = resolve_data_file(data_file and os.path.expanduser(data_file), flag=FLAG)
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(records)})
