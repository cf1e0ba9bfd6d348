"""`python -m olmo_ds.model`: the presets with their exact parameter counts and training FLOPs per token."""

from olmo_ds.model.config import PRESETS


def main() -> None:
    print(f"{'preset':<10} {'params':>16} {'non-embedding':>16} {'layers':>6} {'d_model':>7} {'heads/kv':>8} "
          f"{'seq':>5} {'GFLOP/token':>11}")
    for name, cfg in PRESETS.items():
        print(f"{name:<10} {cfg.num_params():>16,} {cfg.num_params(include_embedding=False):>16,} {cfg.n_layers:>6} "
              f"{cfg.d_model:>7} {f'{cfg.n_heads}/{cfg.n_kv_heads}':>8} {cfg.max_seq_len:>5} "
              f"{cfg.flops_per_token(cfg.max_seq_len) / 1e9:>11.2f}")


if __name__ == "__main__":
    main()
