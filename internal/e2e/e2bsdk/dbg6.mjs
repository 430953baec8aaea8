import { Sandbox } from 'e2b'
const mode = process.argv[2]
const sbx = await Sandbox.create()
if (mode === 'mkdir') await sbx.files.makeDir('/tmp/nd/inner')
else if (mode === 'stat') { await sbx.files.makeDir('/tmp/nd/inner'); await sbx.commands.run('ls /tmp/nd/inner') }
else await sbx.commands.run('mkdir -p /tmp/nd/inner')
const t0 = Date.now()
for (let round = 0; round < 2; round++) {
  const events = []
  const wh = await sbx.files.watchDir('/tmp/nd', (ev) => events.push([Date.now() - t0, ev.name, ev.type]), {recursive: true})
  await sbx.files.write(`/tmp/nd/inner/w${round}.txt`, 'x')
  await sbx.commands.run(`touch /tmp/nd/inner/t${round}.txt`)
  await sbx.files.write(`/tmp/nd/inner/x${round}.txt`, 'x')
  await new Promise(r => setTimeout(r, 1000))
  console.log(mode, round, JSON.stringify(events.map(e=>e[1]+':'+e[2])))
  await wh.stop()
}
await sbx.kill()
