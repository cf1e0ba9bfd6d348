"""Import a transformers OLMo-2/3 model directory as an olmo-ds model directory to continue pretraining.

    python scripts/import_hf.py path/to/OLMo-2-0425-1B models/olmo2-1b

OUT holds model_config.json (our ModelConfig), model.safetensors (fp32, our parameter names) and the
tokenizer files; see olmo_ds/weights.py. Converting back with scripts/export_hf.py is bit-identical.
"""

import argparse
import sys

from olmo_ds.weights import import_hf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="transformers model directory (config.json + *.safetensors)")
    p.add_argument("out", help="olmo-ds model directory to write")
    args = p.parse_args()
    try:
        cfg, out = import_hf(args.hf_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {cfg.num_params():,} parameters, {cfg.n_layers} layers, d_model {cfg.d_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
