import { Sandbox } from 'e2b'
const sbx = await Sandbox.create()
console.log(sbx.sandboxId)
try { console.log(await sbx.files.write('notes/hello.txt', 'hello world')) } catch (e) { console.log('write failed', e) }
try { console.log(await sbx.commands.run('echo hi')) } catch (e) { console.log('run failed', e.message) }
await sbx.kill()
