"""The Tinker SDK's protobuf bodies, read and written with the SDK's own generated messages.

The SDK (0.38) sends `/api/v1/forward_backward` as a `ForwardBackwardRequest` protobuf and asks for
`ForwardBackwardOutput` and `SampleResponse` results as protobuf (`Accept: application/x-protobuf`); every
other body is JSON. This module owns the conversion between those messages and plain tensors:
`read_forward_backward` (one `FwdBwdDatum` per datum: its tokens and its `loss_fn_inputs` as dense
tensors), `forward_backward_output` and `sample_response` (the bytes a finished future returns, with prompt
log-probs where asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from hybridflow.engine.rollout.scoring import PromptLogprobs

PROTO_CONTENT_TYPE = "application/x-protobuf"
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A request the server cannot read; its message names the field and what would be valid."""


@dataclass
class FwdBwdDatum:
    """One datum of a forward_backward: the input tokens and its loss inputs (name -> dense tensor)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    """A decoded `ForwardBackwardRequest`: the loss, its config, and the data."""

    model_id: str
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[FwdBwdDatum]


def _tensor(name: str, msg: pb.Tensor) -> torch.Tensor:
    """A torch tensor of a dense proto `Tensor`."""
    if msg.dtype not in _NUMPY:
        raise WireError(f"loss_fn_inputs[{name!r}] has dtype {pb.DType.Name(msg.dtype)}; valid: float32, int64")
    if msg.HasField("sparse_csr"):  # the SDK sends 2-D targets (several per position) sparse
        raise WireError(f"loss_fn_inputs[{name!r}] is sparse (2-D targets); this server takes one target per "
                        f"position, as 1-D dense inputs")
    values = np.frombuffer(msg.dense, dtype=_NUMPY[msg.dtype]).copy()
    return torch.from_numpy(values.reshape(list(msg.shape)) if len(msg.shape) else values)


def _tokens(index: int, chunks) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{index}].model_input has a {kind} chunk; this server takes "
                            f"only EncodedTextChunk (token ids)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return tokens


def read_forward_backward(body: bytes) -> FwdBwdRequest:
    """Decode the SDK's `/api/v1/forward_backward` body (a `ForwardBackwardRequest` protobuf)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf runtime raises its own DecodeError
        raise WireError(f"forward_backward body is not a ForwardBackwardRequest protobuf ({e}); "
                        f"send it with the tinker SDK") from e
    # The SDK dual-writes numbers to loss_fn_config and loss_fn_config_v2; v2 also carries strings.
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = [FwdBwdDatum(_tokens(i, d.model_input), {k: _tensor(k, t) for k, t in d.loss_fn_inputs.items()})
            for i, d in enumerate(msg.data)]
    return FwdBwdRequest(msg.model_id, msg.loss_fn, config, msg.forward_only, data)


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput` protobuf: per datum its 1-D float32 outputs (e.g. `logprobs`), and metrics
    (names carry the SDK's reduction suffix, e.g. `loss:sum`)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = v
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        arrays = [out[name].detach().to(torch.float32).reshape(-1).numpy() for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                      offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]], prompt: PromptLogprobs | None = None,
                    with_logprobs: bool = False, last_n: int | None = None) -> bytes:
    """A `SampleResponse` protobuf of (tokens, log-probs, finish reason `stop` | `length`) per sequence. With `prompt`
    (the scores of a request that asked for prompt log-probs or their top-k): the prompt's log-probs where
    `with_logprobs`, NaN at its first token (nothing precedes it) and before its last `last_n` tokens where set, and
    the top-k where scored, the SDK's sentinel (token 0 at MASK_LOGPROB) at the positions left out."""
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        msg.sequences.add(stop_reason=_STOP[reason], tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    if prompt is not None:
        n = len(prompt.logprobs) + 1
        start = 1 if last_n is None else n - last_n  # the first position returned
        if with_logprobs:
            values = np.full(n, np.nan, dtype=np.float32)
            values[start:] = prompt.logprobs.numpy()[start - 1:]
            msg.prompt_logprobs = values.tobytes()
        if prompt.top_ids is not None and prompt.top_logprobs is not None:
            k = prompt.top_ids.shape[1]
            ids, lps = np.zeros((n, k), dtype=np.int32), np.full((n, k), MASK_LOGPROB, dtype=np.float32)
            ids[start:], lps[start:] = prompt.top_ids.numpy()[start - 1:], prompt.top_logprobs.numpy()[start - 1:]
            msg.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k,
                                                              length=n))
    return msg.SerializeToString()
