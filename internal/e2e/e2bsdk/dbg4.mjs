import { Sandbox } from 'e2b'
const sbx = await Sandbox.create()
await sbx.files.makeDir('/tmp/newdir/inner')
const t0 = Date.now()
for (let round = 0; round < 6; round++) {
  const events = []
  const wh = await sbx.files.watchDir('/tmp/newdir', (ev) => events.push([Date.now() - t0, ev.name, ev.type]), { recursive: true })
  const tw = Date.now() - t0
  await sbx.files.write(`/tmp/newdir/inner/w${round}.txt`, 'x')
  await new Promise(r => setTimeout(r, 1500))
  console.log(round, 'write at', tw, JSON.stringify(events))
  await wh.stop()
}
await sbx.kill()
