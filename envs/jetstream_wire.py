"""The token-in/token-out wire format: JetStream's Decode messages, extended.

JetStream 0.2.2's `DecodeRequest` carries token ids in (`token_content`) and its
`DecodeResponse` carries token ids out, but neither has sampling settings, stop ids,
logprobs or a finish reason. The messages below are wire supersets of JetStream's: the
fields JetStream knows keep their numbers, the additions take numbers >= 100. The server
(JetStream's gRPC service, unchanged) parses a request as JetStream's message, which keeps
the additions as unknown fields; the orchestrator re-reads them from the bytes. Responses go
the other way. JetStream's own client and tools see ordinary messages and ignore the rest.

    DecodeRequest  { max_tokens = 4; token_content = 6 { repeated int32 token_ids = 1 };
                     sampling = 100 { float temperature = 1; float top_p = 2; int32 top_k = 3;
                                      bool has_seed = 4; uint64 seed = 5 };
                     repeated int32 stop_ids = 101; bool has_stop_ids = 102 }
    DecodeResponse { stream_content = 3 { repeated Sample samples = 1 {
                       string text = 1; repeated int32 token_ids = 2;
                       repeated float logprobs = 100; string finish_reason = 101;
                       int64 weights_version = 102 } } }

The descriptors are built here at import (no generated code, no protoc); only protobuf is
needed, so the client does not import JetStream. Both ends import this module, which belongs to
neither: the client (envs/harness/jetstream_client.py) and the server
(rl/rollout/orchestrator.py).
"""
from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import message_factory

DECODE_METHOD = "/jetstream_proto.Orchestrator/Decode"
HEALTH_METHOD = "/jetstream_proto.Orchestrator/HealthCheck"

_F = descriptor_pb2.FieldDescriptorProto


def _field(msg, name, number, ftype, label=_F.LABEL_OPTIONAL, type_name=None, oneof=None):
  f = msg.field.add(name=name, number=number, type=ftype, label=label)
  if type_name:
    f.type_name = type_name
  if oneof is not None:
    f.oneof_index = oneof
  if label == _F.LABEL_REPEATED and ftype not in (_F.TYPE_MESSAGE, _F.TYPE_STRING):
    f.options.packed = True
  return f


def _build():
  fd = descriptor_pb2.FileDescriptorProto(name="rl_rollout_tito.proto", package="rl_rollout",
                                          syntax="proto3")
  req = fd.message_type.add(name="DecodeRequest")
  tc = req.nested_type.add(name="TokenContent")
  _field(tc, "token_ids", 1, _F.TYPE_INT32, _F.LABEL_REPEATED)
  sp = req.nested_type.add(name="Sampling")
  _field(sp, "temperature", 1, _F.TYPE_FLOAT)
  _field(sp, "top_p", 2, _F.TYPE_FLOAT)
  _field(sp, "top_k", 3, _F.TYPE_INT32)
  _field(sp, "has_seed", 4, _F.TYPE_BOOL)
  _field(sp, "seed", 5, _F.TYPE_UINT64)
  req.oneof_decl.add(name="content")
  _field(req, "max_tokens", 4, _F.TYPE_INT32)
  _field(req, "token_content", 6, _F.TYPE_MESSAGE, type_name=".rl_rollout.DecodeRequest.TokenContent",
         oneof=0)
  _field(req, "sampling", 100, _F.TYPE_MESSAGE, type_name=".rl_rollout.DecodeRequest.Sampling")
  _field(req, "stop_ids", 101, _F.TYPE_INT32, _F.LABEL_REPEATED)
  _field(req, "has_stop_ids", 102, _F.TYPE_BOOL)

  resp = fd.message_type.add(name="DecodeResponse")
  sc = resp.nested_type.add(name="StreamContent")
  sample = sc.nested_type.add(name="Sample")
  _field(sample, "text", 1, _F.TYPE_STRING)
  _field(sample, "token_ids", 2, _F.TYPE_INT32, _F.LABEL_REPEATED)
  _field(sample, "logprobs", 100, _F.TYPE_FLOAT, _F.LABEL_REPEATED)
  _field(sample, "finish_reason", 101, _F.TYPE_STRING)
  _field(sample, "weights_version", 102, _F.TYPE_INT64)
  _field(sc, "samples", 1, _F.TYPE_MESSAGE, _F.LABEL_REPEATED,
         type_name=".rl_rollout.DecodeResponse.StreamContent.Sample")
  resp.oneof_decl.add(name="content")
  _field(resp, "stream_content", 3, _F.TYPE_MESSAGE,
         type_name=".rl_rollout.DecodeResponse.StreamContent", oneof=0)

  pool = descriptor_pool.DescriptorPool()
  pool.Add(fd)
  get = lambda n: message_factory.GetMessageClass(pool.FindMessageTypeByName(n))
  return get("rl_rollout.DecodeRequest"), get("rl_rollout.DecodeResponse")


DecodeRequest, DecodeResponse = _build()
