// The E2B JS SDK, unmodified, against space's E2B-compatible listener.
//
//   E2B_SDK=e2b|e2b-old E2B_API_KEY=e2b_… E2B_API_URL=http://HOST:PORT \
//   E2B_SANDBOX_URL=http://HOST:PORT node --test suite.mjs
//
// E2B_SDK picks the package: "e2b" (2.51, v2 create/connect endpoints) or "e2b-old"
// (2.45, v1 endpoints and client-side API key checks). internal/e2e/e2b_test.go runs
// it against a real `space serve`.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { WebSocket } from 'undici'

const pkg = process.env.E2B_SDK || 'e2b'
const sdk = await import(pkg)
const {
  Sandbox, CommandExitError, TimeoutError, NotFoundError, FileNotFoundError,
  SandboxNotFoundError, AuthenticationError, FileType, FilesystemEventType,
} = sdk
const sandboxUrl = process.env.E2B_SANDBOX_URL

// waitFor polls cond until it returns a truthy value or the deadline passes.
async function waitFor (what, cond, ms = 30000) {
  const deadline = Date.now() + ms
  for (;;) {
    const v = await Promise.resolve().then(cond).catch(() => false)
    if (v) return v
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}

const tag = `${pkg}-${process.pid}-${Date.now()}`

// A WebSocket echo server for the sandbox (Python's standard library has none):
// the handshake, then every text frame comes back prefixed with "echo: ".
const WS_ECHO_SERVER = `
import base64, hashlib, socket, sys, threading
def recv(c, n):
    b = b''
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def serve(c):
    try:
        req = b''
        while b'\\r\\n\\r\\n' not in req:
            req += c.recv(4096)
        key = [l.split(b':', 1)[1].strip() for l in req.split(b'\\r\\n') if l.lower().startswith(b'sec-websocket-key:')][0]
        accept = base64.b64encode(hashlib.sha1(key + b'258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest())
        c.sendall(b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\nSec-WebSocket-Accept: ' + accept + b'\\r\\n\\r\\n')
        while True:
            b0, b1 = recv(c, 2)
            n = b1 & 127
            if n == 126:
                n = int.from_bytes(recv(c, 2), 'big')
            mask = recv(c, 4) if b1 & 128 else b'\\0\\0\\0\\0'
            data = bytes(x ^ mask[i % 4] for i, x in enumerate(recv(c, n)))
            if b0 & 15 == 8:
                c.sendall(b'\\x88\\x00')
                return
            out = b'echo: ' + data
            c.sendall(bytes([0x81, len(out)]) + out)
    except EOFError:
        pass
    finally:
        c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[1])))
s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
`
let sbx

test('create with metadata and envs; getInfo', async () => {
  sbx = await Sandbox.create({ metadata: { suite: tag, kind: 'main' }, envs: { SANDBOX_VAR: 'from-create' }, timeoutMs: 600_000 })
  assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.templateId, 'base')
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: tag, kind: 'main' })
  assert.ok(info.cpuCount >= 1 && info.memoryMB >= 64)
  assert.ok(info.endAt > info.startedAt)
  assert.equal(info.envdVersion, '0.6.13')
  assert.equal(await sbx.isRunning(), true)
  const same = await Sandbox.getInfo(sbx.sandboxId)
  assert.equal(same.sandboxId, sbx.sandboxId)
})

test('commands.run: output, exit codes, cwd, envs, user, timeout', async () => {
  const r = await sbx.commands.run('echo "out $SANDBOX_VAR"; echo err >&2; whoami; pwd')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'out from-create\nuser\n/home/user\n')
  assert.equal(r.stderr, 'err\n')

  await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError, `got ${e}`)
    assert.equal(e.exitCode, 3)
    assert.equal(e.stderr, 'bad\n')
    assert.match(e.error, /exit status 3/)
    return true
  })

  const chunks = []
  const r2 = await sbx.commands.run('pwd; echo $A $B; id -un', {
    cwd: '/tmp', envs: { A: '1', B: 'two words' }, user: 'root', onStdout: (d) => chunks.push(d),
  })
  assert.equal(r2.stdout, '/tmp\n1 two words\nroot\n')
  assert.equal(chunks.join(''), r2.stdout)

  await assert.rejects(sbx.commands.run('true', { cwd: '/does/not/exist' }))
  const t0 = Date.now()
  await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1500 }), (e) => {
    assert.ok(e instanceof TimeoutError, `got ${e}`)
    return true
  })
  assert.ok(Date.now() - t0 < 15000)
})

test("base template: E2B's tools", async () => {
  const r = await sbx.commands.run('python --version && pip --version && node --version && npm --version && git --version && curl --version && gcc --version && make --version')
  assert.match(r.stdout, /^Python 3\.\d+/)
  assert.match(r.stdout, /\nv\d+\.\d+/) // node
  assert.match(r.stdout, /git version/)
  assert.match(r.stdout, /gcc/)
  // sudo works as on E2B: passwordless for user, quietly (the host name resolves).
  const sudo = await sbx.commands.run('sudo -n id -u && hostname -f')
  assert.equal(sudo.stdout.split('\n')[0], '0')
  assert.equal(sudo.stderr, '')
  const build = await sbx.commands.run('printf "#include <stdio.h>\\nint main(){puts(\\"compiled\\");}\\n" > /tmp/c.c && gcc -o /tmp/c /tmp/c.c && /tmp/c')
  assert.equal(build.stdout, 'compiled\n')
})

test('background commands: list, connect, stdin, kill', async () => {
  const h = await sbx.commands.run('echo started; while read line; do echo "got $line"; done; echo bye', { background: true, stdin: true })
  assert.ok(h.pid > 0)
  await waitFor('first output', () => h.stdout.includes('started'))
  const list = await sbx.commands.list()
  const p = list.find((x) => x.pid === h.pid)
  assert.ok(p, `pid ${h.pid} in ${JSON.stringify(list)}`)
  assert.equal(p.cmd, '/bin/bash')
  assert.equal(p.args.at(-1).startsWith('echo started'), true)

  await sbx.commands.sendStdin(h.pid, 'one\n')
  await waitFor('stdin echo', () => h.stdout.includes('got one'))
  // A second client attaches by pid and sees live output.
  const c = await sbx.commands.connect(h.pid)
  await sbx.commands.sendStdin(h.pid, 'two\n')
  await waitFor('output on the connected handle', () => c.stdout.includes('got two'))
  assert.ok(!c.stdout.includes('got one'))
  await h.disconnect()

  if (typeof sbx.commands.closeStdin === 'function') {
    await sbx.commands.closeStdin(h.pid)
    const res = await c.wait()
    assert.match(res.stdout, /bye\n$/)
  } else {
    assert.equal(await sbx.commands.kill(h.pid), true)
    await assert.rejects(c.wait())
  }

  const k = await sbx.commands.run('sleep 300', { background: true })
  assert.equal(await k.kill(), true)
  await assert.rejects(k.wait(), (e) => {
    assert.ok(e instanceof CommandExitError, `got ${e}`)
    assert.equal(e.exitCode, -1)
    return true
  })
  assert.equal(await sbx.commands.kill(k.pid), false)
  assert.ok(!(await sbx.commands.list()).some((x) => x.pid === k.pid))
})

test('pty: create, sendInput, resize, kill', async () => {
  let out = ''
  const dec = new TextDecoder()
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d, { stream: true }) } })
  await sbx.pty.resize(pty.pid, { cols: 120, rows: 40 })
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; echo "T=$TERM"\n'))
  await waitFor('pty output', () => out.includes('40 120') && out.includes('T=xterm'))
  assert.equal(await sbx.pty.kill(pty.pid), true)
  await assert.rejects(pty.wait())
  assert.equal(await sbx.pty.kill(pty.pid), false)
})

test('files: write, read, list, exists, getInfo, makeDir, rename, remove, watchDir', async () => {
  const w = await sbx.files.write('notes/hello.txt', 'hello world')
  assert.equal(w.path, '/home/user/notes/hello.txt')
  assert.equal(await sbx.files.read('/home/user/notes/hello.txt'), 'hello world')
  const bytes = new Uint8Array(70_000).map((_, i) => i % 251)
  await sbx.files.write('/tmp/bin.dat', bytes.buffer)
  assert.deepEqual(await sbx.files.read('/tmp/bin.dat', { format: 'bytes' }), bytes)
  await sbx.files.write('/tmp/empty', '')
  assert.equal(await sbx.files.read('/tmp/empty'), '')
  const multi = await sbx.files.write([{ path: '/tmp/m/a.txt', data: 'A' }, { path: '/tmp/m/sub/b.txt', data: 'B' }])
  assert.deepEqual(multi.map((x) => x.path).sort(), ['/tmp/m/a.txt', '/tmp/m/sub/b.txt'])
  assert.equal(await sbx.files.read('/tmp/m/sub/b.txt'), 'B')

  const ls = await sbx.files.list('/tmp/m')
  assert.deepEqual(ls.map((e) => `${e.name}:${e.type}`).sort(), ['a.txt:file', 'sub:dir'])
  const deep = await sbx.files.list('/tmp/m', { depth: 2 })
  assert.ok(deep.some((e) => e.path === '/tmp/m/sub/b.txt'))

  assert.equal(await sbx.files.exists('notes/hello.txt'), true)
  assert.equal(await sbx.files.exists('notes/nope.txt'), false)
  const info = await sbx.files.getInfo('notes/hello.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.size, 11)
  assert.equal(info.owner, 'user')
  assert.equal(info.permissions, '-rw-r--r--')

  assert.equal(await sbx.files.makeDir('/tmp/newdir/inner'), true)
  assert.equal(await sbx.files.makeDir('/tmp/newdir/inner'), false)
  const moved = await sbx.files.rename('notes/hello.txt', 'notes/renamed.txt')
  assert.equal(moved.path, '/home/user/notes/renamed.txt')
  await sbx.files.remove('notes')
  assert.equal(await sbx.files.exists('notes'), false)
  await assert.rejects(sbx.files.read('notes/renamed.txt'), (e) => {
    assert.ok(e instanceof FileNotFoundError || e instanceof NotFoundError, `got ${e}`)
    return true
  })
  await assert.rejects(sbx.files.getInfo('/nope'), (e) => e instanceof NotFoundError)

  const events = []
  const wh = await sbx.files.watchDir('/tmp/newdir', (ev) => events.push(ev), { recursive: true })
  await sbx.files.write('/tmp/newdir/inner/w.txt', 'x')
  await waitFor('watch event', () => events.some((ev) => ev.name === 'inner/w.txt' && ev.type === FilesystemEventType.CREATE))
  await wh.stop()
})

test('files: metadata on every path, gzip, octet-stream and streams', async () => {
  // /tmp is a tmpfs (extended attributes); the home directory is the sandbox's root
  // file system, which has none under gVisor: the agent keeps the metadata there.
  for (const path of ['/tmp/meta.txt', 'meta/rel.txt', '/home/user/meta/abs.txt']) {
    const info = await sbx.files.write(path, 'with metadata', { metadata: { owner: 'suite', path } })
    assert.deepEqual(info.metadata, { owner: 'suite', path }, path)
    assert.deepEqual((await sbx.files.getInfo(path)).metadata, { owner: 'suite', path }, path)
  }
  const listed = await sbx.files.list('meta')
  assert.deepEqual(listed.find((e) => e.name === 'rel.txt').metadata, { owner: 'suite', path: 'meta/rel.txt' })
  await sbx.files.rename('meta', 'meta2')
  assert.deepEqual((await sbx.files.getInfo('meta2/rel.txt')).metadata, { owner: 'suite', path: 'meta/rel.txt' })
  await sbx.files.remove('meta2/rel.txt')
  await sbx.files.write('meta2/rel.txt', 'again')
  assert.equal((await sbx.files.getInfo('meta2/rel.txt')).metadata, undefined)
  // A write the server refuses leaves nothing behind.
  await assert.rejects(sbx.files.write('refused/dir/f.txt', 'x', { metadata: { big: 'v'.repeat(5000) } }))
  assert.equal(await sbx.files.exists('refused'), false)

  await sbx.files.write('/tmp/gz.txt', 'zipped content', { gzip: true })
  assert.equal(await sbx.files.read('/tmp/gz.txt', { gzip: true }), 'zipped content')
  await sbx.files.write('/tmp/oct.txt', 'octets', { useOctetStream: true })
  assert.equal(await sbx.files.read('/tmp/oct.txt'), 'octets')
  const enc = new TextEncoder()
  const body = new ReadableStream({ start (c) { c.enqueue(enc.encode('streamed ')); c.enqueue(enc.encode('data')); c.close() } })
  await sbx.files.write('/tmp/stream.txt', body)
  let streamed = ''
  for await (const chunk of await sbx.files.read('/tmp/stream.txt', { format: 'stream' })) streamed += new TextDecoder().decode(chunk)
  assert.equal(streamed, 'streamed data')
})

test('files: symlinks report their resolved target', async () => {
  await sbx.files.write('test_file.txt', 'test')
  await sbx.commands.run('ln -sf test_file.txt symlink_to_file && ln -sf /nowhere dangling && ln -sfn /tmp tmp_link')
  const info = await sbx.files.getInfo('symlink_to_file')
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.symlinkTarget, '/home/user/test_file.txt')
  assert.equal(info.mode, 0o644)
  assert.ok(info.permissions.startsWith('L'), info.permissions)
  const dir = await sbx.files.getInfo('tmp_link')
  assert.equal(dir.type, FileType.DIR)
  assert.equal(dir.symlinkTarget, '/tmp')
  // A link that does not resolve reports its own path and no type (the SDK's list()
  // skips entries of unknown type, as with envd).
  const dangling = await sbx.files.getInfo('dangling')
  const home = await sbx.files.list('.')
  assert.ok(!home.some((e) => e.name === 'dangling'))
  const listedLink = home.find((e) => e.name === 'symlink_to_file')
  assert.equal(listedLink.type, FileType.FILE)
  assert.equal(listedLink.symlinkTarget, '/home/user/test_file.txt')
  assert.equal(dangling.symlinkTarget, '/home/user/dangling')
  assert.equal(dangling.type, undefined)
})

test('signed upload and download URLs', async () => {
  // With a single E2B_SANDBOX_URL the links name no sandbox: space finds the one
  // whose access token signed them. Signed URLs must expire (at most the server's
  // --e2b-signed-url-max-ttl ahead).
  const up = await sbx.uploadUrl('/tmp/signed.txt', { useSignatureExpiration: 60 })
  assert.ok(up.startsWith(sandboxUrl) && up.includes('signature=v1_'))
  const form = new FormData()
  form.append('file', new Blob(['signed upload']), '/tmp/signed.txt')
  const res = await fetch(up, { method: 'POST', body: form })
  assert.equal(res.status, 200, await res.clone().text())
  const down = await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: 60 })
  assert.equal(await (await fetch(down)).text(), 'signed upload')
  // The sandbox headers work as well.
  const headers = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' }
  assert.equal(await (await fetch(down, { headers })).text(), 'signed upload')
  // envd's refusals, with and without the sandbox headers.
  const envdError = async (url, h, message) => {
    const r = await fetch(url, { headers: h })
    assert.equal(r.status, 401, `${url}: ${r.status}`)
    assert.deepEqual(await r.json(), { code: 401, message })
  }
  const expired = await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: -10 })
  const forged = new URL(down)
  forged.searchParams.set('signature', 'v1_forged')
  const unsigned = new URL(down)
  unsigned.searchParams.delete('signature')
  const forever = await sbx.downloadUrl('/tmp/signed.txt')
  for (const h of [{}, headers]) {
    await envdError(expired, h, 'signature is already expired')
    await envdError(forged, h, 'invalid signature')
    await envdError(unsigned, h, 'missing signature query parameter')
    // A URL without an expiration would never expire: refused.
    await envdError(forever, h, 'signature_expiration is required: signed URLs must expire (the SDKs\' useSignatureExpiration option)')
  }
})

test('ports: HTTP and WebSocket to any port, host and header routing, closed ports', async () => {
  const host = sbx.getHost(8000)
  // The listener is 127.0.0.1:PORT: the domain it derives is localhost:PORT, which
  // makes valid URLs (an IP address would not).
  assert.equal(host, `8000-${sbx.sandboxId}.localhost:${new URL(sandboxUrl).port}`)
  assert.doesNotThrow(() => new URL(`http://${host}/`))
  await sbx.files.write('www/hello.txt', 'hello from the sandbox')
  const web = await sbx.commands.run('python3 -m http.server 8000 --directory /home/user/www', { background: true, timeoutMs: 0 })
  await sbx.files.write('/tmp/ws.py', WS_ECHO_SERVER)
  const ws = await sbx.commands.run('python3 /tmp/ws.py 8001', { background: true, timeoutMs: 0 })
  try {
    const headers = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' }
    const r = await waitFor('the web server', async () => {
      const res = await fetch(`${sandboxUrl}/hello.txt`, { headers })
      return res.status === 200 ? res : false
    })
    assert.equal(await r.text(), 'hello from the sandbox')
    // Host routing: <port>-<id>.<domain>, sent to the listener.
    const byHost = await new Promise((resolve, reject) => {
      const u = new URL(sandboxUrl)
      http.get({ host: u.hostname, port: u.port, path: '/hello.txt', headers: { Host: host } }, (res) => {
        let b = ''
        res.on('data', (d) => { b += d })
        res.on('end', () => resolve({ status: res.statusCode, body: b }))
      }).on('error', reject)
    })
    assert.deepEqual(byHost, { status: 200, body: 'hello from the sandbox' })
    // WebSocket through the same route.
    const wsUrl = sandboxUrl.replace(/^http/, 'ws') + '/echo'
    const messages = await waitFor('the WebSocket server', () => new Promise((resolve) => {
      const sock = new WebSocket(wsUrl, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8001' } })
      const got = []
      sock.onopen = () => { sock.send('one'); sock.send('two') }
      sock.onmessage = (ev) => { got.push(ev.data); if (got.length === 2) { sock.close(); resolve(got) } }
      sock.onerror = () => resolve(false)
    }))
    assert.deepEqual(messages, ['echo: one', 'echo: two'])
    // Nothing listens on 8002: 502 naming the port.
    const closed = await fetch(`${sandboxUrl}/`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8002' } })
    assert.equal(closed.status, 502)
    const body = await closed.json()
    assert.equal(body.port, 8002)
    assert.equal(body.message, 'The sandbox is running but port is not open')
  } finally {
    await web.kill()
    await ws.kill()
  }
})

test('Sandbox.list with metadata and state filters, pagination', async () => {
  const other = await Sandbox.create({ metadata: { suite: tag, kind: 'other' } })
  try {
    const mine = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
    assert.deepEqual(mine.map((s) => s.sandboxId).sort(), [sbx.sandboxId, other.sandboxId].sort())
    const one = await Sandbox.list({ query: { metadata: { suite: tag, kind: 'other' }, state: ['running'] } }).nextItems()
    assert.deepEqual(one.map((s) => s.sandboxId), [other.sandboxId])
    assert.equal(one[0].state, 'running')
    assert.equal((await Sandbox.list({ query: { metadata: { suite: tag }, state: ['paused'] } }).nextItems()).length, 0)
    const pager = Sandbox.list({ query: { metadata: { suite: tag } }, limit: 1 })
    const seen = []
    while (pager.hasNext) seen.push(...(await pager.nextItems()))
    assert.deepEqual(seen.map((s) => s.sandboxId).sort(), [sbx.sandboxId, other.sandboxId].sort())
  } finally {
    assert.equal(await other.kill(), true)
  }
  assert.equal(await Sandbox.kill(other.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(other.sandboxId), (e) => e instanceof SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(other.sandboxId), (e) => e instanceof NotFoundError)
})

test('setTimeout moves endAt; metrics', async () => {
  await sbx.setTimeout(120_000)
  let info = await sbx.getInfo()
  const left = info.endAt.getTime() - Date.now()
  assert.ok(left > 100_000 && left <= 121_000, `endAt in ${left} ms`)
  await sbx.setTimeout(600_000)
  info = await sbx.getInfo()
  assert.ok(info.endAt.getTime() - Date.now() > 500_000)
  // The sandbox's own limits, not the host's; a history kept by its node.
  const MiB = 1024 * 1024
  const start = new Date(Date.now() - 3600_000)
  const metrics = await waitFor('two metric samples', async () => {
    const m = await sbx.getMetrics({ start })
    return m.length >= 2 ? m : false
  }, 30_000)
  // The SDK's SandboxInfo has no disk size: read it from the API's sandbox detail.
  const detail = await (await fetch(`${process.env.E2B_API_URL}/sandboxes/${sbx.sandboxId}`, { headers: { 'X-API-KEY': process.env.E2B_API_KEY } })).json()
  assert.ok(detail.diskSizeMB > 0)
  for (const m of metrics) {
    assert.equal(m.cpuCount, info.cpuCount, JSON.stringify(m))
    assert.equal(m.memTotal, info.memoryMB * MiB, JSON.stringify(m))
    assert.equal(m.diskTotal, detail.diskSizeMB * MiB, JSON.stringify(m))
    assert.ok(m.memUsed > 0 && m.memUsed <= m.memTotal && m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100, JSON.stringify(m))
  }
  assert.ok(metrics[0].timestamp < metrics.at(-1).timestamp)
  assert.deepEqual(await sbx.getMetrics({ start: new Date(Date.now() + 3600_000) }), [])
})

// A value only a running process holds (in memory) and a file on the disk: a fork and
// a sandbox made from a snapshot must have both.
const MEMORY_KEEPER = 'v=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d " \\n"); echo $v > /home/user/keeper-first.txt; while true; do echo $v > /home/user/keeper.txt; sleep 0.1; done'

async function memoryAndDisk (s, want) {
  assert.equal(await s.files.read('/home/user/on-disk.txt'), 'written before')
  // The file the process rewrites is removed: only the process, with its value in
  // memory, can bring it back.
  await s.files.remove('/home/user/keeper.txt')
  const again = await waitFor('the process to write its value again', async () => (await s.files.exists('/home/user/keeper.txt')) && (await s.files.read('/home/user/keeper.txt')).trim())
  assert.equal(again, want)
}

test('fork, snapshots and pause without memory', { skip: pkg !== 'e2b' && 'the current SDK covers them (same server logic)' }, async () => {
  await sbx.files.write('/home/user/on-disk.txt', 'written before')
  const keeper = await sbx.commands.run(MEMORY_KEEPER, { background: true, timeoutMs: 0 })
  const value = await waitFor('the keeper to start', async () => (await sbx.files.exists('/home/user/keeper-first.txt')) && (await sbx.files.read('/home/user/keeper-first.txt')).trim())

  // fork: a space clone; the source keeps running.
  let t0 = Date.now()
  const forks = await sbx.fork({ count: 1, timeoutMs: 120_000 })
  console.log(`TIMING fork ${Date.now() - t0} ms`)
  assert.equal(forks.length, 1)
  const fork = forks[0]
  assert.ok(fork instanceof Sandbox, `fork: ${fork}`)
  assert.notEqual(fork.sandboxId, sbx.sandboxId)
  await memoryAndDisk(fork, value)
  assert.ok((await fork.commands.list()).some((p) => p.pid === keeper.pid))
  assert.ok((await sbx.commands.list()).some((p) => p.pid === keeper.pid))

  // createSnapshot → Sandbox.create(snapshotId) → listSnapshots → deleteSnapshot.
  const name = `suite-${process.pid}`
  t0 = Date.now()
  const snap = await sbx.createSnapshot({ name })
  console.log(`TIMING createSnapshot ${Date.now() - t0} ms`)
  assert.equal(snap.snapshotId, name)
  assert.deepEqual(snap.names, [name])
  const listed = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
  assert.deepEqual(listed.map((x) => x.snapshotId), [name])
  assert.ok((await sbx.listSnapshots().nextItems()).some((x) => x.snapshotId === name))
  t0 = Date.now()
  const restored = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 })
  console.log(`TIMING create from snapshot ${Date.now() - t0} ms`)
  assert.notEqual(restored.sandboxId, sbx.sandboxId)
  await memoryAndDisk(restored, value)
  assert.equal((await sbx.getInfo()).state, 'running')
  assert.equal(await restored.kill(), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  await assert.rejects(Sandbox.create(snap.snapshotId))

  // pause({ keepMemory: false }): the disk is kept, the memory is not; connect boots.
  await keeper.kill()
  assert.equal(await fork.pause({ keepMemory: false }), true)
  assert.equal((await fork.getInfo()).state, 'paused')
  const booted = await Sandbox.connect(fork.sandboxId)
  assert.equal((await booted.getInfo()).state, 'running')
  assert.equal(await booted.files.read('/home/user/on-disk.txt'), 'written before')
  assert.ok(!(await booted.commands.list()).some((p) => p.pid === keeper.pid), 'a process survived a pause without memory')
  assert.equal(await booted.kill(), true)
})

test('pause and connect keep files and processes', async () => {
  await sbx.files.write('/tmp/before-pause.txt', 'still here')
  const counter = await sbx.commands.run('n=0; while true; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done', { background: true, timeoutMs: 0 })
  await waitFor('counter running', async () => Number(await sbx.files.read('/tmp/count')) > 3)
  await counter.disconnect()

  assert.equal(await sbx.pause(), true)
  assert.equal(await Sandbox.pause(sbx.sandboxId), false) // already paused
  assert.equal((await sbx.getInfo()).state, 'paused')
  const paused = await Sandbox.list({ query: { metadata: { suite: tag }, state: ['paused'] } }).nextItems()
  assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId])
  // The pause replaced the envd access token: the old object's is refused.
  await assert.rejects(sbx.isRunning())
  await assert.rejects(sbx.commands.run('true'))

  // Sandbox.connect resumes and returns an object with the current token.
  const resumed = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await resumed.getInfo()).state, 'running')
  assert.equal(await resumed.files.read('/tmp/before-pause.txt'), 'still here')
  assert.ok((await resumed.commands.list()).some((p) => p.pid === counter.pid))
  const before = Number(await resumed.files.read('/tmp/count'))
  await waitFor('counter counting again', async () => Number(await resumed.files.read('/tmp/count')) > before + 2)
  const att = await resumed.commands.connect(counter.pid)
  assert.equal(await att.kill(), true)
  // Connecting to a running sandbox is a no-op that keeps it running (and its token).
  await sbx.connect()
  assert.equal(await resumed.isRunning(), true)
})

test('lifecycle: the timeout kills, or pauses with onTimeout pause', async () => {
  const short = await Sandbox.create({ timeoutMs: 2000 })
  await waitFor('expiry', async () => {
    try { await short.getInfo(); return false } catch (e) { return e instanceof SandboxNotFoundError }
  })
  if (pkg !== 'e2b') return // the older SDK covers the v1 paths above; this is the same server logic
  // Paused at the timeout; with autoResume the next envd request wakes it.
  const ap = await Sandbox.create({ timeoutMs: 2000, lifecycle: { onTimeout: 'pause', autoResume: true } })
  await ap.files.write('/tmp/keep.txt', 'kept')
  assert.deepEqual((await ap.getInfo()).lifecycle, { onTimeout: 'pause', autoResume: true })
  await waitFor('auto-pause', async () => (await ap.getInfo()).state === 'paused')
  assert.equal(await ap.files.read('/tmp/keep.txt'), 'kept')
  assert.equal((await ap.getInfo()).state, 'running')
  assert.equal(await ap.kill(), true)
})

test('errors: unknown sandbox and bad API key', async () => {
  await assert.rejects(Sandbox.getInfo('doesnotexist0000000'), (e) => e instanceof SandboxNotFoundError)
  assert.equal(await Sandbox.kill('doesnotexist0000000'), false)
  const badKey = 'e2b_' + '0'.repeat(40)
  await assert.rejects(Sandbox.list({ apiKey: badKey }).nextItems(), (e) => e instanceof AuthenticationError)
  await assert.rejects(Sandbox.create({ apiKey: badKey }), (e) => e instanceof AuthenticationError)
})

test('kill', async () => {
  assert.equal(await sbx.kill(), true)
  assert.equal(await sbx.kill(), false)
  await assert.rejects(sbx.getInfo(), (e) => e instanceof SandboxNotFoundError)
})
