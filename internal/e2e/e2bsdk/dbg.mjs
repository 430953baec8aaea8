import { Sandbox } from 'e2b'
const sbx = await Sandbox.create()
await sbx.files.makeDir('/tmp/newdir/inner')
for (const recursive of [false, true]) {
  const events = []
  const wh = await sbx.files.watchDir('/tmp/newdir', (ev) => events.push(ev), { recursive })
  await sbx.files.write('/tmp/newdir/a.txt', 'x')
  await sbx.files.write('/tmp/newdir/inner/w.txt', 'x')
  await sbx.commands.run('touch /tmp/newdir/b.txt /tmp/newdir/inner/c.txt')
  await new Promise(r => setTimeout(r, 1500))
  console.log(recursive, events)
  await wh.stop()
}
await sbx.kill()
