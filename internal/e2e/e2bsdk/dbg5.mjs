import { Sandbox } from 'e2b'
const mode = process.argv[2]
const sbx = await Sandbox.create()
if (mode === 'mkdir') await sbx.files.makeDir('/tmp/nd')
else await sbx.commands.run('mkdir -p /tmp/nd')
if (mode === 'warm') { const w = await sbx.files.watchDir('/tmp', () => {}); await w.stop() }
const t0 = Date.now()
for (let round = 0; round < 3; round++) {
  const events = []
  const wh = await sbx.files.watchDir('/tmp/nd', (ev) => events.push([Date.now() - t0, ev.name, ev.type]))
  await sbx.files.write(`/tmp/nd/w${round}.txt`, 'x')
  await sbx.commands.run(`touch /tmp/nd/t${round}.txt`)
  await new Promise(r => setTimeout(r, 1000))
  console.log(mode, round, JSON.stringify(events))
  await wh.stop()
}
await sbx.kill()
