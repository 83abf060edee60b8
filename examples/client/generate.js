// Node client for pdserve.v1.GatewayService (docs/client.md): model info, one streamed generation, and the
// structured error of a bad request. Usage: node generate.js HOST:PORT [PROTO_ROOT]
// (PROTO_ROOT: the repository's protos/ directory; default ../../protos relative to this file).
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs"); // installed with @grpc/proto-loader

const address = process.argv[2] || "127.0.0.1:50051";
const protoRoot = process.argv[3] || path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync("pdserve/v1/gateway.proto", {
  includeDirs: [protoRoot], keepCase: true, longs: Number, enums: String, defaults: false, oneofs: true,
});
const pdserve = grpc.loadPackageDefinition(definition).pdserve.v1;
const client = new pdserve.GatewayService(address, grpc.credentials.createInsecure());

// google.rpc.Status and the two detail types pdserve sends (from googleapis' google/rpc/*.proto).
const rpc = protobuf.parse(`
  syntax = "proto3";
  package google.rpc;
  message Any { string type_url = 1; bytes value = 2; }
  message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
  message FieldViolation { string field = 1; string description = 2; }
  message BadRequest { repeated FieldViolation field_violations = 1; }
  message Duration { int64 seconds = 1; int32 nanos = 2; }
  message RetryInfo { Duration retry_delay = 1; }
`, { keepCase: true }).root;

function errorDetails(error) {
  const raw = error.metadata && error.metadata.get("grpc-status-details-bin")[0];
  if (!raw) return [];
  const status = rpc.lookupType("google.rpc.Status").decode(raw);
  return status.details.map((any) => {
    const name = any.type_url.split("/").pop(); // e.g. google.rpc.BadRequest
    const type = { "google.rpc.BadRequest": "BadRequest", "google.rpc.RetryInfo": "RetryInfo" }[name];
    return type ? { type: name, ...rpc.lookupType(`google.rpc.${type}`).toObject(
      rpc.lookupType(`google.rpc.${type}`).decode(any.value), { longs: Number }) } : { type: name };
  });
}

function getModelInfo() {
  return new Promise((resolve, reject) =>
    client.GetModelInfo({}, (error, info) => (error ? reject(error) : resolve(info))));
}

function generate(request) {
  return new Promise((resolve, reject) => {
    const result = { tokens: [], text: "", complete: null };
    const call = client.Generate(request, { deadline: Date.now() + 120000 });
    call.on("data", (response) => {
      if (response.chunk) {
        result.tokens.push(...(response.chunk.token_ids || []));
        result.text += response.chunk.text || "";
      } else if (response.complete) {
        result.complete = response.complete;
      }
    });
    call.on("error", reject);
    call.on("end", () => resolve(result));
  });
}

async function main() {
  const info = await getModelInfo();
  console.log(JSON.stringify({ model: info.model, vocab_size: info.vocab_size, has_tokenizer: info.has_tokenizer }));
  const input = info.has_tokenizer ? { text: "The capital of France is" } : { token_ids: { ids: [1, 2, 3] } };
  const done = await generate({ ...input, max_tokens: 8, ignore_eos: true, sampling: { temperature: 0 } });
  console.log(JSON.stringify({ tokens: done.tokens, text: done.text, finish_reason: done.complete.finish_reason,
    completion_tokens: done.complete.usage.completion_tokens }));
  try {
    await generate({ token_ids: { ids: [1] }, max_tokens: 0 });
    throw new Error("max_tokens 0 was accepted");
  } catch (error) {
    if (error.code === undefined) throw error;
    console.log(JSON.stringify({ code: grpc.status[error.code], message: error.details, details: errorDetails(error) }));
  }
  client.close();
}

main().catch((error) => { console.error(error); process.exit(1); });
