"""KV transfer backends: Mooncake (real, TCP or RDMA) and fake (moves nothing, for control-flow tests)."""

from __future__ import annotations

import abc
import logging
from typing import Sequence

from sglite.srt.disaggregation.base import KVBufferSpec, TransferError

logger = logging.getLogger(__name__)


class TransferBackend(abc.ABC):
    """Moves bytes from this process's registered buffers into a peer's registered buffers."""

    name: str = ""
    moves_data: bool = True

    @abc.abstractmethod
    def register(self, buffers: Sequence[KVBufferSpec]) -> None:
        """Make local buffers addressable by peers."""

    @abc.abstractmethod
    def session_id(self) -> str:
        """How peers address this process."""

    @abc.abstractmethod
    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        """Copy local [src, src+len) to the peer's [dst, dst+len) for every triple; raise TransferError."""


class MooncakeTransferBackend(TransferBackend):
    """Mooncake transfer engine with P2P handshake (no metadata server); TCP on CPU hosts."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: "
                "pip install mooncake-transfer-engine-non-cuda (CPU; needs Debian's libibverbs1 and "
                "librdmacm1) or mooncake-transfer-engine (CUDA)"
                f" ({e})"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialise on {host} ({protocol}): rc={rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, buffers: Sequence[KVBufferSpec]) -> None:
        for b in buffers:
            rc = self._engine.register_memory(b.ptr, b.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register KV buffer {b.name} ({b.nbytes} B): rc={rc}")

    def session_id(self) -> str:
        return self._session

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        if not lengths:
            return
        rc = self._engine.batch_transfer_sync_write(peer_session, src_ptrs, dst_ptrs, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake write of {sum(lengths)} B to {peer_session} failed: rc={rc}")


class FakeTransferBackend(TransferBackend):
    """Moves nothing and always succeeds: for warm-up and control-flow tests, as SGLang's fake backend."""

    name = "fake"
    moves_data = False

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._session = f"fake:{host}"

    def register(self, buffers: Sequence[KVBufferSpec]) -> None:
        return None

    def session_id(self) -> str:
        return self._session

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        return None


def create_transfer_backend(name: str, host: str = "127.0.0.1") -> TransferBackend:
    """Backend by its --disaggregation-transfer-backend name."""
    if name == "mooncake":
        return MooncakeTransferBackend(host)
    if name == "fake":
        return FakeTransferBackend(host)
    raise ValueError(f"--disaggregation-transfer-backend {name!r} is unknown; choose mooncake or fake")
