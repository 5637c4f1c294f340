"""``python -m impasto.vae DATA_DIR --out FILE ...`` is ``impasto train-vae``."""

from impasto.vae.cli import main_train_vae

raise SystemExit(main_train_vae())
