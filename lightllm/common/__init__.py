from .req_table import OutOfRowsError, ReqTable
from .token_table import DoubleFreeError, OutOfTokensError, TokenTable

__all__ = ["TokenTable", "ReqTable", "OutOfTokensError", "DoubleFreeError", "OutOfRowsError"]
