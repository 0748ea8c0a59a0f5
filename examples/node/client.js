#!/usr/bin/env node
// A Node.js client for nnd that speaks the .proto and nothing else.
//
// It loads a model and dispatches it (printing the progress to stderr), checks
// a graph with Scan (shapes only, no weights), then runs it with Trace: add a
// steering vector to one layer's output at the last position and read the
// next-token top 5. Last, it generates a few tokens, printing each step as it
// streams in. Over a unix socket, Trace and Generate go straight to the
// model's worker by its route (GetRoute), one hop; everything else, and every
// call over TCP, goes to the daemon. The results go to stdout as JSON:
//
//   node client.js --address unix:///run/nnd/nnd.sock --model openai-community/gpt2 \
//       --prompt "The Eiffel Tower is in the city of" --layer 5 --scale 4 --new-tokens 5
//
// The graph it sends is the protocol form of
//
//   model.layers[N].output[:, -1, :] += v
//   h = model.layers[N].output.save()
//   logits = model.lm_head.output.save()
//
// `layers` and `lm_head` are the daemon's standard aliases (ModuleInfo.aliases):
// the same paths name GPT-2's transformer.h, Llama's model.layers, BERT's
// encoder layers, so this client runs on any of them.
//
// No generated code: @grpc/proto-loader reads ../../protos at start-up.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const USAGE =
  'usage: node client.js --address ADDR --model PATH --prompt TEXT --layer N ' +
  '[--scale S] [--seed K] [--new-tokens T] [--timeout SECONDS]';

// ------------------------------------------------------------------ arguments

function parseArgs(argv) {
  const opts = { scale: 1, seed: 0, timeout: 300, 'new-tokens': 3 };
  const names = new Set(['address', 'model', 'prompt', 'layer', 'scale', 'seed', 'new-tokens', 'timeout']);
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '-h' || arg === '--help') {
      console.log(USAGE);
      process.exit(0);
    }
    let name;
    let value;
    const eq = arg.indexOf('=');
    if (arg.startsWith('--') && eq > 0) {
      name = arg.slice(2, eq);
      value = arg.slice(eq + 1);
    } else if (arg.startsWith('--')) {
      name = arg.slice(2);
      value = argv[++i];
    }
    if (!names.has(name) || value === undefined) usageError(`bad argument ${JSON.stringify(arg)}`);
    opts[name] = value;
  }
  for (const required of ['address', 'model', 'prompt', 'layer']) {
    if (opts[required] === undefined) usageError(`--${required} is required`);
  }
  for (const name of ['layer', 'seed', 'new-tokens']) {
    const n = Number(opts[name]);
    if (!Number.isInteger(n) || n < 0) usageError(`--${name} must be a non-negative integer`);
    opts[name] = n;
  }
  for (const name of ['scale', 'timeout']) {
    const x = Number(opts[name]);
    if (!Number.isFinite(x)) usageError(`--${name} must be a number`);
    opts[name] = x;
  }
  return opts;
}

function usageError(message) {
  process.stderr.write(`nnd-node: ${message}\n${USAGE}\n`);
  process.exit(2);
}

// ------------------------------------------------------------------ the service

let service = null;

// The nnd.v1.Nnd service, from the .proto files (loaded once).
function nndService() {
  if (service === null) {
    const definition = protoLoader.loadSync('nnd/v1/nnd.proto', {
      includeDirs: [PROTOS],
      keepCase: true, // field names as in the .proto (snake_case)
      longs: String, // int64 as decimal strings: token ids and shapes stay exact
      enums: String, // "OUTPUT", "FLOAT32", "DISPATCHED"
      defaults: true,
      oneofs: true, // each oneof gets a virtual property naming the field that is set
    });
    service = grpc.loadPackageDefinition(definition).nnd.v1.Nnd;
  }
  return service;
}

// A client of the daemon, or of a model's worker (a route's address: the same service).
function connect(address) {
  // Results come in chunks under 4 MiB, so the defaults would do; lifting the
  // limits keeps this client working against daemons with other chunk sizes.
  return new (nndService())(address, grpc.credentials.createInsecure(), {
    'grpc.max_receive_message_length': -1,
    'grpc.max_send_message_length': -1,
  });
}

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

// Every call's metadata: the daemon's token, when NND_TOKEN gives one (a worker asks for the same
// token), and `extra` pairs (a route's epoch).
function metadata(extra = {}) {
  const md = new grpc.Metadata();
  if (process.env.NND_TOKEN) md.set('authorization', `Bearer ${process.env.NND_TOKEN.trim()}`);
  for (const [key, value] of Object.entries(extra)) md.set(key, value);
  return md;
}

function unary(client, method, request, timeout) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata(), { deadline: deadline(timeout) }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

// A server stream: calls onMessage for each message as it arrives; resolves when it ends.
function stream(client, method, request, timeout, onMessage, extra = {}) {
  return new Promise((resolve, reject) => {
    const call = client[method](request, metadata(extra), { deadline: deadline(timeout) });
    call.on('data', (msg) => {
      try {
        onMessage(msg);
      } catch (err) {
        call.cancel();
        reject(err);
      }
    });
    call.on('error', reject);
    call.on('end', resolve);
  });
}

// ------------------------------------------------------------------ routes

// Routes (docs/protocol.md section 1.1): a client on the daemon's host sends a
// model's Trace, Generate and Session straight to the model's worker, one hop
// instead of two; the daemon only says where (GetRoute: a unix socket and an
// epoch). Following them is optional: the daemon forwards what it is sent.
const DATA_METHODS = new Set(['Trace', 'Generate', 'Session']);
// grpc-js's words when no connection could be made: the request never left this process.
const NOT_CONNECTED = 'No connection established';

function isStale(err) {
  return err.code === grpc.status.FAILED_PRECONDITION && err.metadata && err.metadata.get('nnd-route')[0] === 'stale';
}

function notConnected(err) {
  return err.code === grpc.status.UNAVAILABLE && String(err.details || '').includes(NOT_CONNECTED);
}

class Router {
  // `daemon`: the daemon's client; `direct`: follow routes (only over a unix socket: the
  // worker's socket is on the daemon's host, and a TCP client may be elsewhere).
  constructor(daemon, direct) {
    this.daemon = daemon;
    this.direct = direct;
    this.routes = new Map(); // model -> {address, epoch, client}
    this.counts = { direct: 0, daemon: 0, rerouted: 0, fallback: 0 };
  }

  // The model's route, from the cache or the daemon; null: send to the daemon.
  async route(model, timeout) {
    if (this.routes.has(model)) return this.routes.get(model);
    let answer;
    try {
      answer = await unary(this.daemon, 'GetRoute', { model }, timeout);
    } catch (err) {
      if (err.code === grpc.status.UNIMPLEMENTED) return null; // an older daemon: no routes
      throw err;
    }
    if (!answer.address) return null; // no worker now: the daemon dispatches the model
    const route = { address: answer.address, epoch: answer.epoch, client: connect(answer.address) };
    this.routes.set(model, route);
    return route;
  }

  forget(model, route) {
    if (this.routes.get(model) === route) this.routes.delete(model);
    route.client.close();
  }

  viaDaemon(method, request, timeout, onMessage) {
    this.counts.daemon++;
    return stream(this.daemon, method, request, timeout, onMessage);
  }

  // Send a data request by the model's route. Nothing is ever sent twice once a worker may
  // have run it: a resend happens only when the worker refused the call for its epoch (a
  // stale route) or no connection was made at all.
  async stream(method, request, timeout, onMessage) {
    if (!this.direct || !DATA_METHODS.has(method) || request.scan) {
      return this.viaDaemon(method, request, timeout, onMessage);
    }
    const model = request.model;
    for (let attempt = 0; attempt < 2; attempt++) {
      const route = await this.route(model, timeout);
      if (route === null) return this.viaDaemon(method, request, timeout, onMessage);
      let answered = false;
      try {
        this.counts.direct++;
        await stream(route.client, method, request, timeout, (msg) => {
          answered = true;
          onMessage(msg);
        }, { 'nnd-epoch': String(route.epoch) });
        return undefined;
      } catch (err) {
        if (answered || !(isStale(err) || notConnected(err))) {
          if (err.code === grpc.status.UNAVAILABLE) await this.explainLoss(model, route, err);
          throw err;
        }
        // Nothing ran: the worker ended or was replaced. Ask the daemon again and resend.
        this.counts.direct--;
        this.forget(model, route);
        if (attempt === 0) {
          this.counts.rerouted++;
          continue;
        }
        if (notConnected(err)) {
          // The fresh route cannot be reached either (another mount namespace, a socket
          // this user may not open): the daemon can, and forwards the request.
          this.counts.fallback++;
          return this.viaDaemon(method, request, timeout, onMessage);
        }
        throw err;
      }
    }
    return this.viaDaemon(method, request, timeout, onMessage);
  }

  // The worker went away with the request in it: ask the daemon why (Route.lost), and say so.
  async explainLoss(model, route, err) {
    this.forget(model, route);
    try {
      const answer = await unary(this.daemon, 'GetRoute', { model, failed_epoch: route.epoch }, 10);
      if (answer.lost) err.details = `the worker of ${model} ended (${answer.lost}) during this request: ${err.details}`;
    } catch (_) {
      // only a better message
    }
  }

  close() {
    for (const route of this.routes.values()) route.client.close();
    this.routes.clear();
  }
}

// Dispatch: the worker starts and loads the weights; progress streams in, the
// last message has stage "ready" and the model's info.
async function dispatch(client, model, timeout) {
  const stages = [];
  let last = null;
  await stream(client, 'Dispatch', { model }, timeout, (p) => {
    const of = Number(p.total) ? `${p.done}/${p.total} ${p.unit}` : '';
    process.stderr.write(`dispatch: ${p.stage} ${of} ${p.message}\n`);
    if (stages[stages.length - 1] !== p.stage) stages.push(p.stage);
    last = p;
  });
  if (last === null || last.stage !== 'ready') throw new Error('Dispatch ended before its "ready" message');
  return { stages, state: last.model.state };
}

// Scan, Trace or Generate: a stream of TraceResponse (Saved, Chunk, StepTokens,
// then one TraceDone). Each StepTokens goes to onStep as soon as it arrives.
// Returns {saved: Map(node id -> Value), blobs: Map(blob id -> Buffer), done}.
// `router` sends Trace and Generate by the model's route, Scan to the daemon.
async function trace(router, request, timeout, method = 'Trace', onStep = () => {}) {
  const saved = new Map();
  const pieces = new Map();
  let done = null;
  await router.stream(method, request, timeout, (msg) => {
    switch (msg.kind) {
      case 'saved':
        saved.set(msg.saved.node, msg.saved.value);
        break;
      case 'chunk': {
        // The chunks of one blob arrive in order: append.
        const list = pieces.get(msg.chunk.blob) || [];
        list.push(msg.chunk.data);
        pieces.set(msg.chunk.blob, list);
        break;
      }
      case 'step': // only Generate sends them
        onStep(msg.step);
        break;
      case 'done':
        done = msg.done;
        break;
      default:
    }
  });
  if (done === null) throw new Error(`the ${method} stream ended without a TraceDone`);
  const blobs = new Map();
  for (const [id, list] of pieces) blobs.set(id, Buffer.concat(list));
  return { saved, blobs, done };
}

// ------------------------------------------------------------------ tensors

// Bytes per element of each DType.
const ITEMSIZE = {
  FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2, FLOAT64: 8,
  INT64: 8, INT32: 4, INT16: 2, INT8: 1, UINT8: 1, BOOL: 1,
};

function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

// The element bytes of a saved tensor: inline `data`, or its reassembled blob.
function tensorBytes(tensor, blobs) {
  if (tensor.meta) throw new Error('the tensor has no data (a Scan result)');
  if (Number(tensor.blob) === 0) return tensor.data;
  const bytes = blobs.get(tensor.blob);
  if (bytes === undefined) throw new Error(`no chunks arrived for blob ${tensor.blob}`);
  return bytes;
}

// A Tensor message -> {shape, dtype, values (flat, row-major, JS numbers), chunked}.
function decodeTensor(tensor, blobs) {
  const shape = tensor.shape.map(Number);
  const count = shape.reduce((a, b) => a * b, 1);
  const bytes = tensorBytes(tensor, blobs);
  const size = ITEMSIZE[tensor.dtype];
  if (size === undefined) throw new Error(`unknown dtype ${tensor.dtype}`);
  if (bytes.length !== count * size) {
    throw new Error(`tensor of shape [${shape}] ${tensor.dtype} needs ${count * size} bytes, got ${bytes.length}`);
  }
  // DataView with littleEndian=true: correct on any host.
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  const read = {
    FLOAT32: (i) => view.getFloat32(i * 4, true),
    FLOAT64: (i) => view.getFloat64(i * 8, true),
    FLOAT16: (i) => halfToFloat(view.getUint16(i * 2, true)),
    // bfloat16 is the upper half of a float32's bits.
    BFLOAT16: (i) => {
      const scratch = new DataView(new ArrayBuffer(4));
      scratch.setUint32(0, view.getUint16(i * 2, true) << 16, true);
      return scratch.getFloat32(0, true);
    },
    INT64: (i) => Number(view.getBigInt64(i * 8, true)),
    INT32: (i) => view.getInt32(i * 4, true),
    INT16: (i) => view.getInt16(i * 2, true),
    INT8: (i) => view.getInt8(i),
    UINT8: (i) => view.getUint8(i),
    BOOL: (i) => view.getUint8(i) !== 0,
  }[tensor.dtype];
  const values = new Array(count);
  for (let i = 0; i < count; i++) values[i] = read(i);
  return { shape, dtype: tensor.dtype, values, chunked: Number(tensor.blob) !== 0 };
}

// A FLOAT32 constant: little-endian element bytes.
function float32Tensor(values) {
  const data = Buffer.alloc(values.length * 4);
  values.forEach((x, i) => data.writeFloatLE(x, i * 4));
  return { dtype: 'FLOAT32', shape: [values.length], data };
}

// ------------------------------------------------------------------ the steering vector

// Numerical Recipes' 32-bit LCG: state' = 1664525 * state + 1013904223 mod 2^32.
// Element i is (2 * u_i - 1) * scale with u_i = state_i / 2^32, rounded to float32.
// Any client can reproduce it bit for bit.
function steeringVector(width, seed, scale) {
  let state = seed >>> 0;
  const out = new Float32Array(width);
  for (let i = 0; i < width; i++) {
    state = (Math.imul(1664525, state) + 1013904223) >>> 0;
    out[i] = ((state / 4294967296) * 2 - 1) * scale;
  }
  return Array.from(out);
}

// ------------------------------------------------------------------ the graph

function steeringGraph(layerPath, vector) {
  const loc = (line, text) => ({ file: 'client.js', line, text });
  const hook = { path: layerPath, point: 'OUTPUT', invoke: 0, call: 0 };
  // The index of `[:, -1, :]`: (slice(None), -1, slice(None)).
  const lastPosition = {
    tuple: { items: [{ value: { slice: {} } }, { value: { int: -1 } }, { value: { slice: {} } }] },
  };
  const edit = `model.${layerPath}.output[:, -1, :] += v`;
  const nodes = [
    { id: 1, loc: loc(1, edit), module: hook },
    { id: 2, loc: loc(1, edit), op: { name: 'getitem', args: [{ ref: 1 }, lastPosition] } },
    { id: 3, loc: loc(1, edit), constant: { tensor: float32Tensor(vector) } },
    { id: 4, loc: loc(1, edit), op: { name: 'iadd', args: [{ ref: 2 }, { ref: 3 }] } },
    { id: 5, loc: loc(1, edit), op: { name: 'setitem', args: [{ ref: 1 }, lastPosition, { ref: 4 }] } },
    // Read the same hook again: nodes ready at one hook run in id order, so
    // this value includes the edit above.
    { id: 6, loc: loc(2, `h = model.${layerPath}.output.save()`), module: hook },
    { id: 7, loc: loc(2, `h = model.${layerPath}.output.save()`), save: { value: { ref: 6 } } },
    { id: 8, loc: loc(3, 'logits = model.lm_head.output.save()'), module: { path: 'lm_head', point: 'OUTPUT', invoke: 0 } },
    { id: 9, loc: loc(3, 'logits = model.lm_head.output.save()'), save: { value: { ref: 8 } } },
  ];
  return { graph: { nodes, scopes: [] }, layerSave: 7, logitsSave: 9 };
}

// ------------------------------------------------------------------ main

function hiddenSize(info) {
  for (const key of ['hidden_size', 'n_embd', 'd_model']) {
    const n = Number(info.config[key]);
    if (Number.isInteger(n) && n > 0) return n;
  }
  throw new Error(`model ${info.name} reports no hidden size in its config`);
}

function topK(values, offset, count, k) {
  const idx = Array.from({ length: count }, (_, i) => i);
  idx.sort((a, b) => values[offset + b] - values[offset + a] || a - b);
  return idx.slice(0, k).map((i) => ({ id: i, logit: values[offset + i] }));
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const client = connect(opts.address);
  // Routes over a unix socket, unless NND_DIRECT=0 (as the Python client).
  const router = new Router(client, opts.address.startsWith('unix:') && process.env.NND_DIRECT !== '0');
  try {
    const info = await unary(client, 'LoadModel', { model: opts.model }, opts.timeout);
    const width = hiddenSize(info);
    const layerPath = `layers.${opts.layer}`; // the standard alias: any architecture
    const vector = steeringVector(width, opts.seed, opts.scale);
    const { graph, layerSave, logitsSave } = steeringGraph(layerPath, vector);

    const request = { model: info.name, invokes: [{ text: opts.prompt }], graph };
    // Scan: the same graph on the META model, shapes and dtypes only (no weights needed).
    const scanned = await trace(router, request, opts.timeout, 'Scan');
    const scan = {};
    for (const [name, id] of [['layer_output', layerSave], ['logits', logitsSave]]) {
      const t = scanned.saved.get(id).tensor;
      scan[name] = { shape: t.shape.map(Number), dtype: t.dtype, meta: t.meta };
    }

    const dispatched = await dispatch(client, info.name, opts.timeout);
    const { saved, blobs, done } = await trace(router, request, opts.timeout);
    for (const id of [layerSave, logitsSave]) {
      if (!saved.has(id) || saved.get(id).kind !== 'tensor') throw new Error(`node ${id} saved no tensor`);
    }
    const layer = decodeTensor(saved.get(layerSave).tensor, blobs);
    const logits = decodeTensor(saved.get(logitsSave).tensor, blobs);

    // logits: [batch (1), positions, vocab]; the next token is read at the last position.
    const [, positions, vocab] = logits.shape;
    const top = topK(logits.values, (positions - 1) * vocab, vocab, 5);
    const decoded = await unary(
      client,
      'Decode',
      { model: info.name, ids: top.map((t) => ({ ids: [t.id] })) },
      opts.timeout,
    );
    top.forEach((t, i) => {
      t.text = decoded.texts[i];
    });

    // Generate (greedy, no edits): each step's token streams in as it is produced.
    const steps = [];
    if (opts['new-tokens'] > 0) {
      const generation = {
        model: info.name,
        invokes: [{ text: opts.prompt }],
        graph: { nodes: [], scopes: [] },
        generate: { max_new_tokens: opts['new-tokens'], do_sample: false, stream_text: true },
      };
      await trace(router, generation, opts.timeout, 'Generate', (step) => {
        process.stderr.write(`step ${step.step}: ${JSON.stringify(step.text[0])}\n`);
        steps.push({ step: step.step, id: Number(step.ids[0]), text: step.text[0] });
      });
    }

    const checksum = layer.values.reduce((a, b) => a + b, 0);
    const out = {
      model: info.name,
      prompt: opts.prompt,
      layer: layerPath,
      scale: opts.scale,
      seed: opts.seed,
      steering: { width, first: vector.slice(0, 4), checksum: vector.reduce((a, b) => a + b, 0) },
      top5: top,
      layer_output: { shape: layer.shape, dtype: layer.dtype, checksum, chunked: layer.chunked },
      logits: { shape: logits.shape, dtype: logits.dtype, chunked: logits.chunked },
      compute_s: done.compute_s,
      dispatch: dispatched,
      scan,
      generate: steps,
      routes: router.counts,
    };
    process.stdout.write(JSON.stringify(out, null, 2) + '\n');
  } finally {
    router.close();
    client.close();
  }
}

// gRPC failures: one line, exit 1. The daemon's messages may span lines (the
// failing node's source location, then what went wrong): join them.
function describeError(err) {
  const oneLine = (s) => String(s).split('\n').map((l) => l.trim()).filter(Boolean).join(' | ');
  if (err && typeof err.code === 'number') {
    const name = grpc.status[err.code] || `code ${err.code}`;
    const type = err.metadata ? err.metadata.get('nnd-exception-type')[0] : undefined;
    return `nnd-node: ${name}${type ? ` (${type})` : ''}: ${oneLine(err.details || err.message)}`;
  }
  return `nnd-node: ${oneLine(err && err.message ? err.message : err)}`;
}

if (require.main === module) {
  main().catch((err) => {
    process.stderr.write(describeError(err) + '\n');
    process.exit(1);
  });
}

module.exports = { connect, Router, trace, steeringVector, steeringGraph, decodeTensor };
