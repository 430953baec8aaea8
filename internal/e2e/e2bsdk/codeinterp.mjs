// E2B's code interpreter SDK (@e2b/code-interpreter), unmodified, against space: the
// builtin template code-interpreter-v1 and its server on port 49999.
//
//   E2B_API_KEY=e2b_… E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT \
//   node --test codeinterp.mjs
//
// internal/e2e/e2b_test.go (TestE2BCodeInterpreter) runs it against a real `space serve`.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, TimeoutError, NotFoundError } from '@e2b/code-interpreter'

const sandboxUrl = process.env.E2B_SANDBOX_URL
let sbx

test('create: the default template is code-interpreter-v1', async () => {
  sbx = await Sandbox.create({ timeoutMs: 900_000 })
  const info = await sbx.getInfo()
  assert.equal(info.templateId, 'code-interpreter-v1')
  // The plain sandbox API works as on any sandbox.
  assert.equal((await sbx.commands.run('python -c "import pandas; print(pandas.__name__)"')).stdout, 'pandas\n')
})

test('1+1 gives 2', async () => {
  const ex = await sbx.runCode('1+1')
  assert.equal(ex.text, '2')
  assert.equal(ex.error, undefined)
  assert.ok(ex.executionCount >= 1, `execution count ${ex.executionCount}`)
  const next = await sbx.runCode('2+2')
  assert.equal(next.executionCount, ex.executionCount + 1)
})

test('printed output streams while the code runs', async () => {
  const seen = []
  const ex = await sbx.runCode('import sys, time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.7)\nprint("warn", file=sys.stderr)', {
    onStdout: (m) => seen.push([Date.now(), m.line]),
  })
  assert.deepEqual(ex.logs.stdout, ['0\n', '1\n', '2\n'])
  assert.deepEqual(ex.logs.stderr, ['warn\n'])
  assert.equal(seen.length, 3)
  // Delivered as printed, not all at the end.
  assert.ok(seen[2][0] - seen[0][0] >= 1000, `lines arrived ${seen[2][0] - seen[0][0]} ms apart`)
})

test('a matplotlib figure comes back as a PNG result', async () => {
  const ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()')
  assert.equal(ex.error, undefined, JSON.stringify(ex.error))
  const png = ex.results.find((r) => r.png)
  assert.ok(png, `results: ${JSON.stringify(ex.results.map((r) => r.formats()))}`)
  assert.deepEqual([...Buffer.from(png.png, 'base64').subarray(0, 4)], [0x89, 0x50, 0x4e, 0x47])
  assert.ok(png.formats().includes('png'))
})

test('rich results: HTML, JSON, DataFrames', async () => {
  const ex = await sbx.runCode([
    'import pandas as pd',
    'from IPython.display import display, JSON',
    "display(JSON({'a': [1, 2]}))",
    "pd.DataFrame({'x': [1, 2], 'y': ['a', 'b']})",
  ].join('\n'))
  assert.equal(ex.error, undefined, JSON.stringify(ex.error))
  assert.deepEqual(ex.results[0].json, { a: [1, 2] })
  const df = ex.results.find((r) => r.isMainResult)
  assert.match(df.html, /<table/)
  assert.deepEqual(df.data.columns, ['x', 'y'])
  assert.deepEqual(df.data.data, [[1, 'a'], [2, 'b']])
})

test('an exception comes back as an error with its traceback', async () => {
  const errors = []
  const ex = await sbx.runCode('def divide(a, b):\n    return a / b\ndivide(1, 0)', { onError: (e) => errors.push(e) })
  assert.equal(ex.error.name, 'ZeroDivisionError')
  assert.equal(ex.error.value, 'division by zero')
  const tb = ex.error.traceback.replace(/\x1b\[[0-9;]*m/g, '')
  assert.match(tb, /return a \/ b/)
  assert.match(tb, /divide\(1, 0\)/)
  assert.equal(errors.length, 1)
})

test('contexts: state persists within a context, not across; cwd; list; restart; remove', async () => {
  await sbx.runCode('shared = "default context"')
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.language, 'python')
  assert.equal(ctx.cwd, '/tmp')
  const missing = await sbx.runCode('shared', { context: ctx })
  assert.equal(missing.error.name, 'NameError')
  await sbx.runCode('mine = 7', { context: ctx })
  assert.equal((await sbx.runCode('mine * 6', { context: ctx })).text, '42')
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp')
  assert.equal((await sbx.runCode('shared')).text, 'default context')
  assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))

  await sbx.restartCodeContext(ctx)
  assert.equal((await sbx.runCode('mine', { context: ctx })).error.name, 'NameError')
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp')

  await sbx.removeCodeContext(ctx.id)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  await assert.rejects(sbx.runCode('1', { context: ctx }), (e) => e instanceof NotFoundError)
})

test('bash', async () => {
  const ex = await sbx.runCode('X=hello; echo "$X from $(whoami)"', { language: 'bash' })
  assert.deepEqual(ex.logs.stdout, ['hello from user\n'])
  const again = await sbx.runCode('echo "$X again"', { language: 'bash' })
  assert.deepEqual(again.logs.stdout, ['hello again\n'])
  const ctx = await sbx.createCodeContext({ language: 'bash' })
  assert.deepEqual((await sbx.runCode('echo "[$X]"', { context: ctx })).logs.stdout, ['[]\n'])
})

test('environment variables for one execution', async () => {
  const ex = await sbx.runCode('import os; os.environ["SPACE_VAR"]', { envs: { SPACE_VAR: 'only now' } })
  assert.equal(ex.text, 'only now')
  assert.equal((await sbx.runCode('import os; os.environ.get("SPACE_VAR", "gone")')).text, 'gone')
})

test('a timeout interrupts the code; the context lives on', async () => {
  await sbx.runCode('before = 1')
  const t0 = Date.now()
  await assert.rejects(sbx.runCode('import time\ntime.sleep(60)\nafter = 1', { timeoutMs: 2000 }), (e) => e instanceof TimeoutError)
  assert.ok(Date.now() - t0 < 10000)
  const ex = await sbx.runCode('(before, "after" in globals())')
  assert.equal(ex.text, '(1, False)')
})

test('/execute needs the access token', async () => {
  const res = await fetch(`${sandboxUrl}/execute`, {
    method: 'POST',
    headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49999', 'Content-Type': 'application/json' },
    body: JSON.stringify({ code: '1' }),
  })
  assert.equal(res.status, 401)
})

test('the interpreter survives pause and connect', async () => {
  await sbx.runCode('kept = "across a pause"')
  assert.equal(await sbx.pause(), true)
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.runCode('kept')).text, 'across a pause')
  assert.equal((await again.runCode('1+1')).text, '2')
})

test('kill', async () => {
  assert.equal(await sbx.kill(), true)
})
