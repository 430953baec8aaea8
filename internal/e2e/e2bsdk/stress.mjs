import { Sandbox } from 'e2b'
let fails = 0
for (let n = 0; n < 20; n++) {
  const sbx = await Sandbox.create()
  await sbx.files.makeDir('/tmp/newdir/inner')
  const events = []
  const wh = await sbx.files.watchDir('/tmp/newdir', (ev) => events.push(ev.name), { recursive: true })
  await sbx.files.write(`/tmp/newdir/inner/a.txt`, 'x')
  const deadline = Date.now() + 3000
  while (!events.length && Date.now() < deadline) await new Promise(r => setTimeout(r, 20))
  if (!events.length) fails++
  await wh.stop()
  await sbx.kill()
}
console.log('fails', fails, 'of 20')
