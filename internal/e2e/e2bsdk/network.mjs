// E2B's network options with the unmodified E2B JS SDK, against a space serve whose
// sandboxes' egress goes into a fake internet (internal/e2e/network_test.go runs it):
//
//   E2B_API_KEY=e2b_… E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT \
//   ALLOWED_HOST=allowed.test OTHER_ADDR=198.18.2.20 node --test network.mjs
//
// ALLOWED_HOST resolves (in the fake internet's DNS) to a web server; OTHER_ADDR is
// another web server.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, ALL_TRAFFIC } from 'e2b'

const sandboxUrl = process.env.E2B_SANDBOX_URL
const allowed = `http://${process.env.ALLOWED_HOST}/sdk`
const other = `http://${process.env.OTHER_ADDR}/sdk-other`

// fetchFrom runs a fetch of each URL inside the sandbox: "ok" or "fail" per URL.
async function fetchFrom (sbx, ...urls) {
  const script = `import sys, urllib.request
for u in sys.argv[1:]:
    try:
        urllib.request.urlopen(u, timeout=4)
        print("ok", flush=True)
    except Exception:
        print("fail", flush=True)
`
  await sbx.files.write('/tmp/probe.py', script)
  const r = await sbx.commands.run(`python3 /tmp/probe.py ${urls.join(' ')}`)
  return r.stdout.trim().split('\n')
}

async function waitFor (what, cond, ms = 30000) {
  const deadline = Date.now() + ms
  for (;;) {
    const v = await Promise.resolve().then(cond).catch(() => false)
    if (v) return v
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}

test('network: allowOut/denyOut on create, getInfo, updateNetwork', async () => {
  const sbx = await Sandbox.create({ network: { allowOut: [process.env.ALLOWED_HOST], denyOut: [ALL_TRAFFIC] } })
  try {
    assert.deepEqual(await fetchFrom(sbx, allowed, other), ['ok', 'fail'])
    const info = await sbx.getInfo()
    assert.deepEqual(info.network.allowOut, [process.env.ALLOWED_HOST])
    assert.deepEqual(info.network.denyOut, [ALL_TRAFFIC])
    assert.equal(info.allowInternetAccess, false)
    // Replace-all: only the other address now.
    await sbx.updateNetwork({ allowOut: [process.env.OTHER_ADDR], denyOut: [ALL_TRAFFIC] })
    assert.deepEqual(await fetchFrom(sbx, allowed, other), ['fail', 'ok'])
    const after = await Sandbox.getInfo(sbx.sandboxId)
    assert.deepEqual(after.network.allowOut, [process.env.OTHER_ADDR])
    // allowInternetAccess true with nothing else: open egress.
    await sbx.updateNetwork({ allowInternetAccess: true })
    assert.deepEqual(await fetchFrom(sbx, allowed, other), ['ok', 'ok'])
    assert.equal((await sbx.getInfo()).allowInternetAccess, true)
  } finally {
    await sbx.kill()
  }
})

test('network: allowInternetAccess false; header rules are kept but not shown', async () => {
  const sbx = await Sandbox.create({
    allowInternetAccess: false,
    network: {
      rules: { [process.env.ALLOWED_HOST]: [{ transform: { headers: { Authorization: 'Bearer sdk-secret' } } }] },
      allowOut: [process.env.ALLOWED_HOST],
    },
  })
  try {
    assert.deepEqual(await fetchFrom(sbx, allowed, other), ['ok', 'fail'])
    const info = await sbx.getInfo()
    assert.equal(info.allowInternetAccess, false)
    assert.ok(info.network.rules[process.env.ALLOWED_HOST], 'the rule is listed')
    assert.ok(!JSON.stringify(info).includes('sdk-secret'), 'the secret is not shown')
  } finally {
    await sbx.kill()
  }
})

test('network: bad input is an error naming the field', async () => {
  await assert.rejects(Sandbox.create({ network: { allowOut: ['10.0.0.0/33'] } }), /network\.allow_out\[0\]/)
  const sbx = await Sandbox.create()
  try {
    await assert.rejects(sbx.updateNetwork({ denyOut: ['not a cidr'] }), /network\.deny_out\[0\]/)
  } finally {
    await sbx.kill()
  }
})

test('network: allowPublicTraffic false needs the traffic access token; maskRequestHost', async () => {
  const sbx = await Sandbox.create({ network: { allowPublicTraffic: false, maskRequestHost: 'masked.internal:${PORT}' } })
  try {
    assert.ok(sbx.trafficAccessToken, 'a private sandbox has a traffic access token')
    const server = `import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = ("host=" + self.headers.get("Host", "")).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
`
    await sbx.files.write('/tmp/host.py', server)
    const srv = await sbx.commands.run('python3 /tmp/host.py', { background: true, timeoutMs: 0 })
    try {
      const headers = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' }
      const withToken = { ...headers, 'e2b-traffic-access-token': sbx.trafficAccessToken }
      const r = await waitFor('the server', async () => {
        const res = await fetch(`${sandboxUrl}/`, { headers: withToken })
        return res.status === 200 ? res : false
      })
      assert.equal(await r.text(), 'host=masked.internal:8000')
      const denied = await fetch(`${sandboxUrl}/`, { headers })
      assert.equal(denied.status, 403)
    } finally {
      await srv.kill()
    }
  } finally {
    await sbx.kill()
  }
})
