package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/browser"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/bench"
)

// TestConsole drives the web console (/ui/) in Debian's headless Chromium against a
// real space serve: sign in with a bad key and a good one, create a sandbox and watch
// it become running over the event stream, type into the terminal, watch a process's
// output arrive live and replay it from an offset, upload and download a file, suspend
// and wake. It fails on any Content-Security-Policy violation or uncaught exception in
// the page. Screenshots go to $SPACE_SCREENSHOT_DIR (docs/images when refreshing the
// documentation's), else to a temporary directory.
func TestConsole(t *testing.T) {
	chromium := findChromium(t)
	s := start(t, options{})

	shots := os.Getenv("SPACE_SCREENSHOT_DIR")
	if shots == "" {
		shots = t.TempDir()
	}
	downloads := t.TempDir()
	b := newBrowser(t, chromium, downloads)
	defer b.checkPage()

	// Sign-in: a bad key gets the API's words, the admin key gets in.
	b.do("open the console", chromedp.Navigate(s.URL+"/ui/"), chromedp.WaitVisible(chromedp.ID("apikey")))
	b.do("type a bad key", chromedp.SendKeys(chromedp.ID("apikey"), "spk_not_a_real_key\n"))
	b.waitText("#signin-msg", "Sign-in failed: invalid API key")
	b.shot(shots, "console-signin-error.png")
	b.setValue("apikey", "")
	b.do("type the admin key", chromedp.SendKeys(chromedp.ID("apikey"), s.Key+"\n"))
	b.waitText("main h1", "Sandboxes")
	b.poll("focus on the page heading", `document.activeElement && document.activeElement.tagName === 'H1'`)

	// An API error is shown as the API words it.
	b.do("create with an unknown template",
		chromedp.SendKeys(chromedp.ID("create-template"), "nope:1"),
		chromedp.Click(chromedp.ID("create-submit")))
	b.waitText("main form .alert", `Create failed: template "nope:1" not found`)

	// Create a sandbox; the list shows it running without a reload (event stream).
	b.setValue("create-template", "")
	b.do("create a sandbox",
		chromedp.SendKeys(chromedp.ID("create-metadata"), "purpose=console-test"),
		chromedp.Click(chromedp.ID("create-submit")))
	b.poll("the created link", `document.getElementById('created-link')`)
	id := b.eval(`document.getElementById('created-link').textContent`)
	t.Logf("sandbox %s", id)
	b.waitState(fmt.Sprintf(`tr[data-id=%q] td.state`, id), "running")
	b.do("filter by metadata", chromedp.SendKeys(chromedp.ID("filter-metadata"), "purpose=console-test"))
	b.waitText("#sandbox-count", "1 of 1 sandboxes shown")
	b.shot(shots, "console-sandboxes.png")

	// Terminal: a PTY shell; what we type runs and its output is drawn.
	b.do("open the terminal tab", chromedp.Navigate(s.URL+"/ui/#/sandboxes/"+id+"/terminal"))
	b.do("start a shell", chromedp.Click(chromedp.ID("term-start")))
	b.waitText("#term-status", "Shell running")
	b.poll("a prompt", `document.getElementById('term-text').textContent.includes('#')`)
	b.do("type a command", chromedp.SendKeys(chromedp.CSS(".term-input"), "echo hello-$((6*7)); tput cols\n"))
	b.poll("the command's output in the terminal", `/hello-42\s+\d+\s/.test(document.getElementById('term-text').textContent)`)
	cols := b.eval(`document.getElementById('term-text').textContent.match(/hello-42\s+(\d+)/)[1]`)
	if cols == "" || cols == "80" {
		// The page sized the PTY to its box (1280 px wide window: well over 80 columns).
		t.Errorf("tput cols = %q: the terminal was not resized to its box", cols)
	}
	b.shot(shots, "console-terminal.png")
	b.do("exit the shell", chromedp.SendKeys(chromedp.CSS(".term-input"), "exit 3\n"))
	b.waitText("#term-status", "Shell exited with code 3")

	// Processes: output arrives while the process runs, then replays from an offset.
	b.do("open the processes tab", chromedp.Click(chromedp.ID("tab-processes")))
	b.do("run a command",
		chromedp.SendKeys(chromedp.ID("run-command"), "echo first; sleep 3; echo second >&2"),
		chromedp.Click(chromedp.ID("run-submit")))
	b.waitText("#process-output", "first")
	if out := b.eval(`document.getElementById('process-output').textContent`); strings.Contains(out, "second") {
		t.Errorf("the first line arrived only with the last one (%q): output is not live", out)
	}
	b.waitText("#process-state", "Running")
	b.waitText("#process-state", "exited with code 0")
	if out := b.eval(`document.getElementById('process-output').textContent`); out != "first\nsecond\n" {
		t.Errorf("process output %q", out)
	}
	b.poll("stderr shown as such", `document.querySelector('#process-output .stderr')?.textContent === 'second\n'`)
	b.setValue("replay-offset", "6")
	b.do("replay from byte 6", chromedp.Click(chromedp.ID("replay")))
	b.waitText("#process-state", "exited with code 0")
	if out := b.eval(`document.getElementById('process-output').textContent`); out != "second\n" {
		t.Errorf("replay from byte 6: %q, want %q", out, "second\n")
	}
	b.shot(shots, "console-processes.png")

	// Files: upload random bytes, check them through the API, download them back.
	data := make([]byte, 300<<10+17)
	rand.Read(data)
	local := filepath.Join(t.TempDir(), "upload.bin")
	if err := os.WriteFile(local, data, 0o644); err != nil {
		t.Fatal(err)
	}
	b.do("open the files tab", chromedp.Click(chromedp.ID("tab-files")))
	b.poll("the /root listing", `document.querySelector('#panel-files tbody tr')`)
	b.do("upload a file", chromedp.SetUploadFiles(chromedp.ID("files-upload"), []string{local}), chromedp.Click(chromedp.ID("files-upload-btn")))
	b.poll("the uploaded file listed", `document.querySelector('#panel-files tr[data-name="upload.bin"]')`)
	rc, err := s.C.ReadFile(ctx(t, time.Minute), id, "/root/upload.bin", client.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("uploaded file: %d bytes (err %v), want the %d bytes sent", len(got), err, len(data))
	}
	b.shot(shots, "console-files.png")
	b.do("download it", chromedp.Click(chromedp.CSS(`#panel-files tr[data-name="upload.bin"] button[aria-label^="Download"]`)))
	dl := waitDownload(t, downloads, len(data))
	if !bytes.Equal(dl, data) {
		t.Fatalf("downloaded %d bytes that differ from the %d uploaded", len(dl), len(data))
	}

	// Suspend and wake: the state changes arrive live, the operations show up.
	b.do("open the overview", chromedp.Click(chromedp.ID("tab-overview")), chromedp.Click(chromedp.ID("verb-suspend")))
	b.waitState("#sandbox-state", "suspended")
	b.poll("the suspend operation succeeded", `document.querySelector('#timeline li[data-kind="suspend"].succeeded')`)
	b.do("wake", chromedp.Click(chromedp.ID("verb-wake")))
	b.waitState("#sandbox-state", "running")
	b.poll("the wake operation succeeded", `document.querySelector('#timeline li[data-kind="wake"].succeeded')`)
	b.shot(shots, "console-sandbox.png")

	// The other pages render (each asks the API; none may show an error).
	for _, p := range []struct{ hash, heading, sel string }{
		{"#/nodes", "Nodes", "section[data-node]"},
		{"#/templates", "Templates", "a[href^='#/templates/base']"},
		{"#/keys", "API keys", "td"},
		{"#/pools", "Warm pools", "td"},
	} {
		b.do("open "+p.hash, chromedp.Navigate(s.URL+"/ui/"+p.hash))
		b.waitText("main h1", p.heading)
		b.poll(p.heading+" content", fmt.Sprintf(`document.querySelector(%q)`, "main "+p.sel))
		if alert := b.eval(`(document.querySelector('main .alert') || {}).textContent || ''`); alert != "" {
			t.Errorf("%s shows an error: %s", p.hash, alert)
		}
		if p.hash == "#/nodes" {
			b.shot(shots, "console-nodes.png")
		}
	}
	// A build spec the API refuses: its words are shown.
	b.do("open #/templates", chromedp.Navigate(s.URL+"/ui/#/templates"))
	b.waitText("main h1", "Templates")
	b.setValue("build-spec", "name: with:colon\n")
	b.do("submit the spec", chromedp.Click(chromedp.ID("build-submit")))
	b.waitText("main form .alert", "Build refused: name \"with:colon\" must not contain ':' or '@'")

	// Benchmarks: what `space bench` saved is plotted.
	if err := bench.SaveLast(s.DataDir, bench.Report{FinishedAt: time.Now(), Template: "base", Runs: 20, Results: []bench.Result{
		{Scenario: "cold-create", Metric: "POST → exit of true", Unit: "ms", Runs: 20, Median: 391, P95: 438, Baseline: "runsc run true", BaselineMedian: 139, BaselineP95: 150, Ratio: 2.82},
		{Scenario: "exec", Metric: "round trip of true", Unit: "ms", Runs: 20, Median: 31.5, P95: 44.4, Baseline: "runsc exec true", BaselineMedian: 27.5, BaselineP95: 30, Ratio: 1.15},
		{Scenario: "throughput", Metric: "1 GiB stdout via SSE", Unit: "MiB/s", Runs: 5, Median: 29.4, P95: 35.5},
	}}); err != nil {
		t.Fatal(err)
	}
	b.do("open #/bench", chromedp.Navigate(s.URL+"/ui/#/bench"))
	b.poll("the plots", `document.querySelectorAll('svg.plot').length === 2 && document.querySelectorAll('#bench-host tbody tr').length === 3`)
	b.shot(shots, "console-bench.png")

	// Keyboard: the sandbox page's tabs follow the arrow keys.
	b.do("open the sandbox page", chromedp.Navigate(s.URL+"/ui/#/sandboxes/"+id), chromedp.Focus(chromedp.ID("tab-overview")))
	b.do("press the right arrow", chromedp.KeyEvent(kb.ArrowRight))
	b.poll("the processes tab selected and focused", `document.activeElement.id === 'tab-processes' && !document.getElementById('panel-processes').hidden && location.hash.endsWith('/processes')`)

	// Phone width: the list is still usable (no horizontal page scroll).
	b.do("phone width", chromedp.EmulateViewport(390, 844), chromedp.Navigate(s.URL+"/ui/#/sandboxes"))
	b.waitState(fmt.Sprintf(`tr[data-id=%q] td.state`, id), "running")
	if w := b.eval(`String(document.documentElement.scrollWidth <= window.innerWidth + 1)`); w != "true" {
		t.Errorf("the page scrolls sideways at 390 px")
	}
	b.shot(shots, "console-phone.png")

	// Delete from the list, through the confirmation dialog.
	b.do("delete", chromedp.Click(chromedp.CSS(fmt.Sprintf(`tr[data-id=%q] button.danger`, id))), chromedp.Click(chromedp.ID("confirm-ok")))
	b.poll("the row gone", fmt.Sprintf(`!document.querySelector('tr[data-id=%q]')`, id))
}

// findChromium returns Debian's Chromium, or skips.
func findChromium(t *testing.T) string {
	for _, name := range []string{os.Getenv("SPACE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"} {
		if name == "" {
			continue
		}
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("no Chromium installed (apt-get install chromium; scripts/setup.sh installs it)")
	return ""
}

// tab is a browser tab driven by one test.
type tab struct {
	t   *testing.T
	ctx context.Context
}

// newBrowser starts a headless Chromium for this machine (root, no network, no GPU).
func newBrowser(t *testing.T, path, downloads string) *tab {
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // Chromium refuses to run as root with its sandbox
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("no-proxy-server", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	)
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelA)
	bctx, cancelB := chromedp.NewContext(actx)
	t.Cleanup(cancelB)
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	b := &tab{t: t, ctx: bctx}
	// Record CSP violations from the first byte of every page (DevTools scripts are
	// not subject to the page's policy).
	if _, err := chromedp.Call(bctx, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{
		Source: `window.__csp = []; document.addEventListener('securitypolicyviolation', e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));`,
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.CallBrowser(bctx, browser.SetDownloadBehavior, browser.SetDownloadBehaviorParams{
		Behavior: browser.SetDownloadBehaviorBehaviorAllowAndName, DownloadPath: downloads,
	}); err != nil {
		t.Fatal(err)
	}
	msgs := chromedp.Console(bctx)
	go func() {
		for m, err := range msgs {
			if err != nil {
				return
			}
			if m.IsException() || strings.Contains(m.Text, "Content Security Policy") || strings.Contains(m.Text, "Refused to") {
				t.Errorf("page console: %s:%d %s", m.URL, m.Line+1, m.Text)
			}
		}
	}()
	return b
}

// fail reports what the page shows, with a screenshot, and stops the test.
func (b *tab) fail(what string, err error) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	text, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	if png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot()); err == nil {
		p := filepath.Join(os.TempDir(), "space-console-failure.png")
		_ = os.WriteFile(p, png, 0o644)
		b.t.Logf("screenshot of the failure: %s", p)
	}
	b.t.Fatalf("%s: %v\npage text:\n%s", what, err, text)
}

func (b *tab) do(what string, steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		b.fail(what, err)
	}
}

// poll waits until the JavaScript expression is truthy (2 minutes at most: a wake or a
// first template build may take that long on a loaded machine).
func (b *tab) poll(what, expr string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute+10*time.Second)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingTimeout(2*time.Minute), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
		b.fail("waiting for "+what, err)
	}
}

// waitText waits until the element selected by sel contains text.
func (b *tab) waitText(sel, text string) {
	b.t.Helper()
	b.poll(fmt.Sprintf("%q in %s", text, sel), fmt.Sprintf(`(() => { const e = document.querySelector(%q); return e && e.textContent.includes(%q); })()`, sel, text))
}

// waitState waits until the state shown in sel is state and no transition is shown
// (the observed state, not the desired one after an arrow).
func (b *tab) waitState(sel, state string) {
	b.t.Helper()
	b.poll(fmt.Sprintf("state %s in %s", state, sel), fmt.Sprintf(`(() => { const e = document.querySelector(%q);
		return e && e.querySelector('.badge')?.textContent === %q && !e.textContent.includes('→'); })()`, sel, state))
}

func (b *tab) eval(expr string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
	if err != nil {
		b.fail("evaluate "+expr, err)
	}
	return v
}

// setValue sets an input's value as a user's edit would (with an input event).
func (b *tab) setValue(id, v string) {
	b.t.Helper()
	b.eval(fmt.Sprintf(`(() => { const e = document.getElementById(%q); e.value = %q; e.dispatchEvent(new Event('input', {bubbles: true})); return ''; })()`, id, v))
}

func (b *tab) shot(dir, name string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, chromedp.Evaluate[chromedp.Void](`window.scrollTo(0, 0)`)); err != nil {
		b.fail("scroll up", err)
	}
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.fail("screenshot "+name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		b.t.Fatal(err)
	}
}

// checkPage fails on CSP violations the page recorded.
func (b *tab) checkPage() {
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`window.__csp || []`))
	if err == nil && len(v) > 0 {
		b.t.Errorf("Content-Security-Policy violations: %v", v)
	}
}

// waitDownload waits for the one completed download in dir of n bytes.
func waitDownload(t *testing.T, dir string, n int) []byte {
	t.Helper()
	var data []byte
	waitFor(t, time.Minute, "the download to complete", func() bool {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasSuffix(e.Name(), ".crdownload") {
				continue
			}
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err == nil && len(b) == n {
				data = b
				return true
			}
		}
		return false
	})
	return data
}
