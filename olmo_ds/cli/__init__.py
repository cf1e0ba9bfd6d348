"""The entry points that another process starts by module name: `python -m olmo_ds.cli.NAME`.

`scripts/pretrain.py`, `scripts/prepare_data.py`, `scripts/validate_shards.py`, `scripts/merge_shards.py` and
`scripts/register_token_files.py` are these same
`main` functions. They live in the package because the tools (`olmo_ds.tools`) and the deepspeed,
torchrun and Slurm launchers start them as fresh processes, which must work from an installed
package too (`deepspeed --module olmo_ds.cli.pretrain ...`). The logic stays in the rooms
(`olmo_ds.train`, `olmo_ds.data`); these modules parse arguments and report errors.
"""
