// Latency of common E2B SDK calls against a running space server:
//
//   E2B_API_KEY=e2b_… E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \
//   node bench.mjs [runs]
//
// Prints median and p95 (milliseconds) over `runs` (default 20) of:
//   create+run   Sandbox.create() until the first commands.run('echo hi') resolved
//   run true     commands.run('true') round trip in a running sandbox
//   files 1MiB   files.write + files.read of 1 MiB
import { Sandbox } from 'e2b'

const runs = Number(process.argv[2] ?? 20)

function summary (name, ms) {
  const s = [...ms].sort((a, b) => a - b)
  const q = (p) => s[Math.min(s.length - 1, Math.ceil(p * s.length) - 1)]
  console.log(`${name.padEnd(12)} n=${s.length}  median ${q(0.5).toFixed(1)} ms  p95 ${q(0.95).toFixed(1)} ms  (min ${s[0].toFixed(1)}, max ${s.at(-1).toFixed(1)})`)
}

async function timed (fn) {
  const t0 = performance.now()
  await fn()
  return performance.now() - t0
}

const create = []
for (let i = 0; i < runs; i++) {
  let sbx
  create.push(await timed(async () => {
    sbx = await Sandbox.create()
    const r = await sbx.commands.run('echo hi')
    if (r.stdout !== 'hi\n') throw new Error(`unexpected output ${JSON.stringify(r.stdout)}`)
  }))
  await sbx.kill()
}

const sbx = await Sandbox.create()
try {
  await sbx.commands.run('true') // warm the connections
  const run = []
  for (let i = 0; i < runs; i++) run.push(await timed(() => sbx.commands.run('true')))

  const data = new Uint8Array(1 << 20).map((_, i) => (i * 7) % 256)
  const files = []
  for (let i = 0; i < runs; i++) {
    files.push(await timed(async () => {
      await sbx.files.write('/tmp/bench.bin', data.buffer)
      const got = await sbx.files.read('/tmp/bench.bin', { format: 'bytes' })
      if (got.length !== data.length) throw new Error(`read ${got.length} bytes`)
    }))
  }
  summary('create+run', create)
  summary('run true', run)
  summary('files 1MiB', files)
} finally {
  await sbx.kill()
}
