import { Sandbox } from 'e2b'
const mode = process.argv[2]
let fails = 0
const N = 12
for (let n = 0; n < N; n++) {
  const sbx = await Sandbox.create()
  let dir = '/tmp/newdir'
  if (mode === 'home') dir = '/home/user'
  else if (mode === 'tmp' || mode === 'tmpwait') dir = '/tmp'
  else if (mode === 'cmd') await sbx.commands.run('mkdir -p /tmp/newdir')
  else if (mode === 'late') { await sbx.files.makeDir('/tmp/newdir'); await new Promise(r => setTimeout(r, 1000)) }
  else if (mode === 'delay') { await new Promise(r => setTimeout(r, 400)); await sbx.files.makeDir('/tmp/newdir') }
  else await sbx.files.makeDir('/tmp/newdir')
  const events = []
  let exitErr = 'none'
  const wh = await sbx.files.watchDir(dir, (ev) => events.push(ev.name), { onExit: (e) => { exitErr = String(e) } })
  if (mode === 'tmpwait') await new Promise(r => setTimeout(r, 300))
  await sbx.files.write(`${dir}/a.txt`, 'x')
  const deadline = Date.now() + 2000
  while (!events.length && Date.now() < deadline) await new Promise(r => setTimeout(r, 20))
  if (!events.length) { fails++; console.log('FAILED', sbx.sandboxId, exitErr); continue }
  await wh.stop()
  await sbx.kill()
}
console.log(mode, 'fails', fails, 'of', N)
