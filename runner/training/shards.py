"""Reading a checkpoint folder's DCP shards without running code from it, resharded to the job's layout.

``torch.distributed.checkpoint`` reads two things with the full unpickler: the folder's ``.metadata``, and every
non-tensor item of a state dict (an optimizer's ``lr``), which it stores as a pickled byte item. Whoever can write a
checkpoint folder could then run code on every machine that resumes, exports or compares from it, and the digest file
does not help: it is rewritten as easily. So the metadata is read with an unpickler that builds DCP's own classes by
exact name, and each byte item with ``torch.load(weights_only=True)``; a refusal is a :class:`CheckpointError` like
damage, and :func:`~runner.training.checkpoint.load_latest` then takes the previous good checkpoint.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.training.checkpoint import CheckpointError, dcp_error, pickled_objects, read_checkpoint

if TYPE_CHECKING:
    import torch


# Every global a DCP ``.metadata`` of runner's names, by exact module and name: DCP's own metadata classes, sizes,
# layouts and paths (dtypes are checked apart). A prefix such as "any name under torch.distributed.checkpoint" is not
# enough: pickle protocol 4 resolves a dotted name, so ``filesystem`` + ``os.system`` reaches any function.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the globals of :data:`_METADATA_GLOBALS` and torch's dtypes, each by exact name; refuses every other."""

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." not in name and (dtype or name in _METADATA_GLOBALS.get(module, ())):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(
            f"refused: its .metadata names {module}.{name}, which is not one of DCP's metadata classes; "
            "unpickling it could run code"
        )


def _weights_only(value: io.BytesIO, fqn: str) -> Any:
    """One non-tensor item of a checkpoint (an optimizer's ``lr``, say), read with ``torch.load(weights_only=True)``:
    DCP's own planner unpickles these without that limit, which runs whatever a crafted shard pickles."""
    import torch

    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refused: its item {fqn} carries pickled objects ({pickled_objects(exc)}) that loading would execute"
        ) from None


def _planner(keys: set[str] | None = None) -> Any:
    """DCP's load planner (with ``keys``: the one that builds those keys from the metadata alone), reading every
    non-tensor item with :func:`_weights_only`."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class WeightsOnly(DefaultLoadPlanner if keys is None else _EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], _weights_only(value, fqn))
            else:
                self.state_dict[fqn] = _weights_only(value, fqn)

    return WeightsOnly() if keys is None else WeightsOnly(keys=keys)


def _reader(folder: Path) -> Any:
    """DCP's ``FileSystemReader`` of ``folder`` whose ``.metadata`` is read here, first, with
    :class:`_MetadataUnpickler`: a refusal is then a CheckpointError of its own, not one of DCP's wrapped failures.

    Raises CheckpointError: The metadata names a global outside DCP's own, or does not unpickle."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with (folder / ".metadata").open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{folder}: {exc}") from None

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def load_checkpoint(folder: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (``{"model", "optimizer"}`` of ``get_state_dict``, whole or sharded) from a checkpoint folder,
    resharded to this job's layout (a collective under a process group)."""
    import torch.distributed.checkpoint as dcp

    reader = _reader(folder)
    try:
        dcp.load(state, storage_reader=reader, planner=_planner())
    except (Exception, dcp.CheckpointException) as exc:
        raise CheckpointError(f"{folder}: the shards do not load ({dcp_error(exc)})") from None


def whole_model(folder: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The model state dict of the checkpoint ``folder`` (``key="ema"``: the weights' moving average), whole and on
    CPU, read without a process group."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader, alone = _reader(folder), not (dist.is_available() and dist.is_initialized())
    try:  # what DCP's _load_state_dict_from_keys does, with runner's reader and planner
        _load_state_dict(state, storage_reader=reader, planner=_planner({key}), no_dist=alone)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{folder}: the shards do not load ({dcp_error(exc)})") from None
    return dict(state[key])


def read_with_model(path: Path) -> dict[str, Any]:
    """:func:`read_checkpoint`'s payload with the whole model under ``"model"`` (:func:`whole_model`): for
    :func:`load_latest`, so a checkpoint whose shards do not load is passed over as a damaged one is."""
    return {**read_checkpoint(path), "model": whole_model(path)}
