"""Generated protobuf / gRPC code for pdserve.internal.v1: PrefillService, DecodeService, KVTransferService
(run scripts/gen_protos.sh; do not edit). Between pdserve's own processes only, not a public API."""
