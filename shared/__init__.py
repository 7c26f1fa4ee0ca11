"""gmlx_contract: the image step contract shared by the gmlx server and its clients.

Constants and the version rule, the tensor container, content hashes, error types and the
requests-based step client. Depends on numpy and requests only.
"""

from .client import StepAnswer, StepClient
from .errors import ContractError, ContractMismatch, NotGmlxServer, StepError, WireError
from .hashing import canonical_json, hash_parts, is_digest, table_id, tensor_hash
from .version import CONTRACT_VERSION, HEADER, MIN_CLIENT, check_request_version
from .wire import (
    CONTAINER_TYPE,
    DTYPES,
    Container,
    check_body_size,
    is_container_type,
    read_container,
    write_container,
)

__all__ = [
    "CONTAINER_TYPE",
    "CONTRACT_VERSION",
    "DTYPES",
    "HEADER",
    "MIN_CLIENT",
    "Container",
    "ContractError",
    "ContractMismatch",
    "NotGmlxServer",
    "StepAnswer",
    "StepClient",
    "StepError",
    "WireError",
    "canonical_json",
    "check_body_size",
    "check_request_version",
    "hash_parts",
    "is_container_type",
    "is_digest",
    "read_container",
    "table_id",
    "tensor_hash",
    "write_container",
]
