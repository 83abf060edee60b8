"""Generated protobuf / gRPC code for the pdserve.v1 API (rpc.v1) (run scripts/gen_protos.sh; do not edit)."""
