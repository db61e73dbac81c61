"""A trained predictor on disk: JSON only, checksummed, optionally HMAC-signed. Nothing is ever unpickled.

File layout (one JSON object)::

    {"format": "trainguard-predictor", "version": 1,
     "sha256": "<hex of the canonical payload>", "hmac_sha256": "<hex or null>",
     "payload": {"kind": "hgb", "feature_spec": {...}, "feature_names": [...], "threshold": 0.83,
                 "eval_config": {...}, "training_summary": {...}, "params": {...}}}

The canonical payload is ``json.dumps(payload, sort_keys=True, separators=(",", ":"))``. The SHA-256 catches
corruption and truncation. When a key is given (argument or the ``TRAINGUARD_PREDICTOR_KEY`` environment
variable) the file is signed with HMAC-SHA256 over the canonical payload, and loading with a key refuses a
file whose signature is absent or wrong. Why JSON and not a pickle: a model file may be copied between
clusters; loading it must not be able to run code. The trees are a few hundred KiB of numbers at most.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.predictor.calibration import CalibrationConfig
from trainguard.predictor.errors import ModelFileError
from trainguard.predictor.evaluation import EvalConfig
from trainguard.predictor.features import FeatureSpec
from trainguard.predictor.scorers import SCORERS, Scorer

FORMAT = "trainguard-predictor"
VERSION = 1
#: Environment variable holding the HMAC key (any string) used to sign and verify model files.
KEY_ENV = "TRAINGUARD_PREDICTOR_KEY"


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _key(key: str | bytes | None) -> bytes | None:
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    return key.encode() if isinstance(key, str) else key


class _NonJSONConstant(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in a file: Python's json reads them, JSON has no such value."""


def _refuse_constant(name: str) -> Any:
    raise _NonJSONConstant(name)


def json_safe(obj: Any) -> Any:
    """Replaces NaN/inf (not valid JSON) with None, recursively."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return json_safe(obj.item())
    return obj


@dataclass
class PredictorModel:
    """A scorer with everything needed to use it on new data.

    Attributes:
        spec: features the scorer expects (metrics and windows).
        scorer: the scorer.
        threshold: alarm threshold on the score, calibrated to the false-alarm budget.
        eval_config: horizon, checkpoint time, cooldown and budget the threshold was calibrated for.
        training_summary: what it was trained on (rows, nodes, node-days, failures, metrics, calibration).
        calibration: per-node online threshold calibration (:mod:`.calibration`); None: the fixed
            ``threshold`` for every node (files written before it existed).
    """

    spec: FeatureSpec
    scorer: Scorer
    threshold: float
    eval_config: EvalConfig = field(default_factory=EvalConfig)
    training_summary: dict[str, Any] = field(default_factory=dict)
    calibration: CalibrationConfig | None = None

    @property
    def kind(self) -> str:
        """Scorer kind (``hgb``, ``robust-z``, ``threshold``)."""
        return self.scorer.kind

    def payload(self) -> dict[str, Any]:
        """JSON-ready content of the model file."""
        return json_safe({
            "kind": self.kind, "feature_spec": self.spec.to_dict(), "feature_names": self.spec.feature_names,
            "threshold": self.threshold, "eval_config": self.eval_config.to_dict(),
            "training_summary": self.training_summary, "params": self.scorer.to_params(),
            **({"calibration": self.calibration.to_dict()} if self.calibration is not None else {}),
        })

    def save(self, path: str | Path, key: str | bytes | None = None) -> int:
        """Writes the model file atomically (temp file + rename).

        Args:
            path: destination.
            key: HMAC key; default ``$TRAINGUARD_PREDICTOR_KEY``; unsigned when neither is set.

        Returns:
            The file size, bytes.
        """
        payload = self.payload()
        body = _canonical(payload)
        k = _key(key)
        doc = {
            "format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(body).hexdigest(),
            "hmac_sha256": hmac.new(k, body, hashlib.sha256).hexdigest() if k else None, "payload": payload,
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        data = json.dumps(doc, separators=(",", ":")).encode()
        try:
            with tmp.open("wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ModelFileError(
                f"{path}: cannot write model file ({exc.strerror}); check that its folder exists and is writable"
            ) from exc
        return len(data)

    @classmethod
    def load(cls, path: str | Path, key: str | bytes | None = None) -> "PredictorModel":
        """Reads and verifies a model file.

        Args:
            path: model file.
            key: HMAC key; default ``$TRAINGUARD_PREDICTOR_KEY``. With a key the signature must be present and
                valid; without one only the checksum is checked.

        Returns:
            The model.

        Raises:
            ModelFileError: unreadable, not a model file, other version, checksum or signature mismatch, or
                malformed content.
        """
        path = Path(path)
        try:
            doc = json.loads(path.read_bytes(), parse_constant=_refuse_constant)
        except OSError as exc:
            raise ModelFileError(f"{path}: cannot read model file ({exc.strerror}); check the path") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"{path}: not a JSON model file (corrupted or truncated?); retrain or restore it") from exc
        except _NonJSONConstant as exc:
            # save() never writes one (allow_nan=False), so the file was edited or produced elsewhere
            raise ModelFileError(
                f"{path}: model file holds {exc}, which is not JSON and never written by trainguard; the file was "
                "altered, retrain or restore it"
            ) from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ModelFileError(f"{path}: not a trainguard predictor model file")
        if doc.get("version") != VERSION:
            raise ModelFileError(f"{path}: model format version {doc.get('version')!r}, this trainguard reads {VERSION}; retrain")
        payload = doc.get("payload")
        if not isinstance(payload, dict):
            raise ModelFileError(f"{path}: model file has no payload; retrain")
        body = _canonical(payload)
        if not hmac.compare_digest(str(doc.get("sha256")), hashlib.sha256(body).hexdigest()):
            raise ModelFileError(f"{path}: checksum mismatch, the model file was altered or corrupted; retrain or restore it")
        k = _key(key)
        if k is not None:
            sig = doc.get("hmac_sha256")
            if not isinstance(sig, str) or not hmac.compare_digest(sig, hmac.new(k, body, hashlib.sha256).hexdigest()):
                raise ModelFileError(
                    f"{path}: HMAC signature missing or wrong for the configured key; use the key it was signed "
                    f"with (${KEY_ENV}) or retrain"
                )
        try:
            spec = FeatureSpec.from_dict(payload["feature_spec"])
            names = list(payload["feature_names"])
            if names != spec.feature_names:
                raise ModelFileError(f"{path}: stored feature list differs from the one its spec derives; retrain")
            kind = payload["kind"]
            if kind not in SCORERS:
                raise ModelFileError(f"{path}: unknown scorer kind {kind!r}; known: {sorted(SCORERS)}")
            scorer = SCORERS[kind].from_params(names, payload["params"])
            threshold = float(payload["threshold"])
            ev = EvalConfig(**payload.get("eval_config", {}))
            cal = CalibrationConfig(**payload["calibration"]) if payload.get("calibration") else None
        except ModelFileError:
            raise
        except Exception as exc:  # malformed fields of any sort: one clear refusal
            raise ModelFileError(f"{path}: malformed model content ({type(exc).__name__}: {exc}); retrain") from exc
        return cls(spec, scorer, threshold, ev, dict(payload.get("training_summary") or {}), cal)
