"""The offline data pipeline: raw text (or tokens made elsewhere) → shard directories.

Nothing here runs during training. Training reads shard directories through `olmo_ds.data` (the
format in `shards`, the read path in `dataset`, `loader`, `order`, `mixture`, `config`), which
imports nothing from this package (`tests/structure/test_walls.py`), so the read path never carries
tokenizer backends, worker pools or readers for compressed text.

- `pipeline`: `prepare(PrepareConfig)`, the orchestration (`scripts/prepare_data.py`);
- `worker`: what a worker process does: parse and tokenize a block, whole files into pieces;
- `readers`: raw text in input order (JSON lines, gzip, zstd, .txt, Parquet);
- `backend`: which library encodes (`fastokens` only where it gives HF's exact ids);
- `pool`: the worker processes, results in submission order;
- `pieces`: whole-file mode, workers tokenize whole files into pieces that are cut into shards;
- `output`: what an output directory may resume and the writers that record where;
- `report`: skips, progress and the summary the user reads;
- `partition`: one corpus prepared on many machines and merged (`scripts/merge_shards.py`);
- `token_files`: OLMo's released `.npy` token files registered in place (`scripts/register_token_files.py`);
- `megatron`: to and from the Megatron-LM indexed format (`scripts/convert_shards.py`);
- `sample_corpus`: the demo's corpus from the standard library (`scripts/make_sample_corpus.py`).

`olmo_ds.data.validate` stays beside the format: it checks any shard directory, whoever wrote it.
"""
