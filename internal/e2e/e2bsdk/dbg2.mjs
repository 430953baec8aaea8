import assert from 'node:assert/strict'
import { Sandbox, FileType, FilesystemEventType, NotFoundError, FileNotFoundError } from 'e2b'
async function waitFor (what, cond, ms = 10000) {
  const deadline = Date.now() + ms
  for (;;) {
    const v = await Promise.resolve().then(cond).catch(() => false)
    if (v) return v
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}
const test = async (name, fn) => { try { await fn() ; console.log('ok', name) } catch (e) { console.log('FAIL', name, e.stack, globalThis.EV) } }
const sbx = await Sandbox.create()
await test('files: write, read, list, exists, getInfo, makeDir, rename, remove, watchDir', async () => {
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
  globalThis.EV = events; await waitFor('watch event', () => events.some((ev) => ev.name === 'inner/w.txt' && ev.type === FilesystemEventType.CREATE))
  console.log(events); await wh.stop()
})
await sbx.kill()
