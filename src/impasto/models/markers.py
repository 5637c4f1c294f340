"""What a single file says about how it samples: ComfyUI's ``v_pred`` / ``ztsnr`` marker keys.

A v-prediction SDXL checkpoint (NoobAI-XL V-Pred and its kin) carries an empty ``v_pred`` tensor,
and ``ztsnr`` when its schedule has zero terminal SNR (comfy/supported_models.py, SDXL). Training
such a model with an epsilon objective teaches it the wrong target and ruins it within steps, so
that pairing is refused before the model loads.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

V_PRED_KEY = "v_pred"
ZTSNR_KEY = "ztsnr"


def marker_keys(path: str | Path) -> set[str]:
    """The marker keys in the header of the ``.safetensors`` file ``path`` (none for another
    kind of file, or one that cannot be read: its loader reports that)."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors" or not path.is_file():
        return set()
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key for key in (V_PRED_KEY, ZTSNR_KEY) if key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError):
        return set()


def check_objective_fits(path: str | Path, prediction_type: str, zero_terminal_snr: bool) -> None:
    """A one-line error when the file at ``path`` is a v-prediction model (or a zero-terminal-SNR
    one) and the objective trains another target (or schedule)."""
    markers = marker_keys(path)
    if V_PRED_KEY in markers and prediction_type != "v_prediction":
        raise ValueError(
            f"model.path {path} is a v-prediction model (it has the v_pred key), but "
            f"objective.prediction_type is {prediction_type}; set objective.prediction_type: "
            "v_prediction (and zero_terminal_snr: true if it has ztsnr), or start from "
            "configs/sdxl-vpred-lora.yaml"
        )
    if ZTSNR_KEY in markers and not zero_terminal_snr:
        raise ValueError(
            f"model.path {path} was trained with zero terminal SNR (it has the ztsnr key), but "
            "objective.zero_terminal_snr is false; set objective.zero_terminal_snr: true"
        )
