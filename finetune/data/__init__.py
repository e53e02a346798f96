"""Training data: sources -> tokenized token cache (memory-mapped) -> fixed-length samples -> a global order.

    python -m finetune.data prepare --config configs/tiny.yaml [key=value ...]   # tokenize ahead of the job
    python -m pytest tests/test_data.py -q

What this package owns, one module per thing a person changes (each imports only those above it):

    errors.py    DataError, and how every error names a row ('<file> row <1-based line>')
    sources.py   sources and formats: files, saved folders, hub names, mixtures   (a new data format goes here)
    samples.py   fixed-length samples cut from the memory-mapped cache: padding, packing, labels (IGNORE)
    chat.py      chat rendering and prompt masking (assistant turns carry the loss)
    cache.py     the parallel, atomic cache build (datasets.map -> tokens.bin, loss_mask.bin, doc_offsets.bin)
    order.py     the global order and the batch stream: what exact resume depends on. The order is a pure
                 function of (seed, epoch, global sample index) and each rank takes a contiguous slice of
                 every global batch, so it is independent of the world size; a checkpoint stores only the
                 number of samples consumed. Change it only with the bit-identical resume tests passing.
    __main__.py  `python -m finetune.data prepare`

May import: the standard library, numpy, torch, datasets/pyarrow/transformers (lazily, inside the functions
that need them), common.dist (collectives), and, in __main__.py only, finetune.config and finetune.model.
Never ckpt/ or train_fsdp.py. This file re-exports the names the rest of the project uses.
"""

from finetune.data.cache import COMMIT_FILE, build_cache, cache_path
from finetune.data.chat import tokenize_chat, tokenize_chat_batch
from finetune.data.errors import DataError
from finetune.data.order import BATCH_KEY, BatchSplit, BatchStream, GlobalOrder
from finetune.data.samples import IGNORE, ArraySamples, Samples, TokenCache, check_samples, open_samples
from finetune.data.sources import load_documents

__all__ = ["BATCH_KEY", "COMMIT_FILE", "IGNORE", "ArraySamples", "BatchSplit", "BatchStream", "DataError",
           "GlobalOrder", "Samples", "TokenCache", "build_cache", "cache_path", "check_samples", "load_documents",
           "open_samples", "tokenize_chat", "tokenize_chat_batch"]
