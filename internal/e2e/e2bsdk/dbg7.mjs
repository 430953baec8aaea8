import { Sandbox } from 'e2b'
let fails = 0
for (let n = 0; n < 8; n++) {
  const sbx = globalThis.S ?? (globalThis.S = await Sandbox.create())
  await sbx.files.makeDir('/tmp/newdir/inner')
  const t0 = Date.now()
  const events = []
  const wh = await sbx.files.watchDir('/tmp/newdir', (ev) => events.push([Date.now() - t0, ev.name, ev.type]), { recursive: true })
  await sbx.files.write(`/tmp/newdir/inner/a.txt`, 'x')
  await new Promise(r => setTimeout(r, 1000))
  const first = events.length
  await sbx.files.write(`/tmp/newdir/inner/b.txt`, 'x')
  await sbx.files.write(`/tmp/newdir/c.txt`, 'x')
  await new Promise(r => setTimeout(r, 1000))
  if (first === 0) { fails++; console.log('after 1s none; later:', JSON.stringify(events)) }
  await wh.stop()
  await sbx.files.remove("/tmp/newdir")
}
console.log('fails', fails)
