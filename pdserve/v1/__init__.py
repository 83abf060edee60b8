"""Generated protobuf / gRPC code for the pdserve.v1 API (run scripts/gen_protos.sh; do not edit)."""
