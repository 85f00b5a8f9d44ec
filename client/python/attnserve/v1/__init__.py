"""Generated at build time from proto/attnserve/v1/attention.proto (attention_pb2, attention_pb2_grpc)."""
