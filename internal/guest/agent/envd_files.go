package agent

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/guest/wire"
)

// envd's plain HTTP file endpoints: GET /files?path=&username= streams a file (gzip
// when the client accepts it), POST /files writes files from a multipart body (one
// part per file, named "file", the filename parameter being the full target path) or
// from a raw body (application/octet-stream, optionally gzip-encoded) to ?path=.
// X-Metadata-<key> headers set file metadata. Errors are JSON {code, message}.

// envdWriteInfo is one entry of POST /files's answer.
type envdWriteInfo struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// fileAccount resolves the ?username= of a /files request.
func (e *envd) fileAccount(w http.ResponseWriter, r *http.Request) (account, bool) {
	name := r.URL.Query().Get("username")
	acct, err := e.account(name)
	if err != nil {
		envdError(w, http.StatusUnauthorized, "invalid user %q: %v", name, err)
		return account{}, false
	}
	return acct, true
}

// acceptsGzip reads the client's Accept-Encoding (as relayed by the gateway).
func acceptsGzip(h http.Header) (gz, ok bool) {
	v := h.Get(envdpb.AcceptEncodingHeader)
	if v == "" {
		v = h.Get("Accept-Encoding")
	}
	identity := true
	for _, item := range strings.Split(v, ",") {
		name, params, _ := strings.Cut(strings.TrimSpace(item), ";")
		zero := strings.ReplaceAll(strings.TrimSpace(params), " ", "") == "q=0"
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "gzip":
			if !zero {
				gz = true
			}
		case "identity", "*":
			if zero {
				identity = false
			}
		}
	}
	return gz, gz || identity
}

func (e *envd) handleGetFile(w http.ResponseWriter, r *http.Request) {
	acct, ok := e.fileAccount(w, r)
	if !ok {
		return
	}
	p := r.URL.Query().Get("path")
	if p == "" {
		envdError(w, http.StatusBadRequest, "path is required")
		return
	}
	path, err := resolvePath(acct, p)
	if err != nil {
		e.writeEnvdError(w, r, err)
		return
	}
	f, err := os.Open(path)
	if err != nil {
		e.writeEnvdError(w, r, err)
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		e.writeEnvdError(w, r, err)
		return
	}
	if fi.IsDir() {
		envdError(w, http.StatusBadRequest, "path %s is a directory", path)
		return
	}
	if !fi.Mode().IsRegular() {
		envdError(w, http.StatusBadRequest, "path %s is not a regular file", path)
		return
	}
	gz, ok := acceptsGzip(r.Header)
	if !ok {
		envdError(w, http.StatusNotAcceptable, "no acceptable content encoding (gzip and identity are supported)")
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": filepath.Base(path)}))
	h.Set("Vary", "Accept-Encoding")
	if gz {
		h.Set("Content-Encoding", "gzip")
		w.WriteHeader(http.StatusOK)
		zw, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
		if _, err := io.Copy(zw, f); err == nil {
			_ = zw.Close()
		}
		return
	}
	h.Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	w.WriteHeader(http.StatusOK)
	if _, err := io.CopyN(w, f, fi.Size()); err != nil {
		e.a.log.Debug("envd read file: copy", "path", path, "err", err)
	}
}

// uploadMetadata collects X-Metadata-<key> headers (keys lowercased).
func uploadMetadata(h http.Header) (map[string]string, error) {
	var md map[string]string
	for name, vals := range h {
		key, ok := strings.CutPrefix(strings.ToLower(name), "x-metadata-")
		if !ok {
			continue
		}
		if key == "" {
			return nil, badRequest("empty metadata key")
		}
		v := strings.Join(vals, ",")
		for _, c := range v {
			if c < 0x20 || c > 0x7e {
				return nil, badRequest("metadata value for %q must be printable ASCII", key)
			}
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = v
	}
	return md, nil
}

// partFilename returns the filename parameter of a part verbatim (the SDKs put the
// full target path there; multipart.Part.FileName would keep only its base name),
// undoing the percent-escapes browsers and undici use for quotes and line breaks.
func partFilename(p *multipart.Part) string {
	_, params, err := mime.ParseMediaType(p.Header.Get("Content-Disposition"))
	if err != nil {
		return ""
	}
	return strings.NewReplacer("%22", `"`, "%0A", "\n", "%0D", "\r").Replace(params["filename"])
}

func (e *envd) handlePostFiles(w http.ResponseWriter, r *http.Request) {
	acct, ok := e.fileAccount(w, r)
	if !ok {
		return
	}
	md, err := uploadMetadata(r.Header)
	if err == nil {
		err = validateMetadata(md)
	}
	if err != nil {
		e.writeEnvdError(w, r, err)
		return
	}
	qpath := r.URL.Query().Get("path")
	var out []envdWriteInfo
	// A request that fails leaves nothing behind: the files and directories it
	// created are removed again (files it overwrote keep their new content).
	var undo []func()
	fail := func(status int, format string, args ...any) {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		envdError(w, status, format, args...)
	}
	failErr := func(err error) {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		e.writeEnvdError(w, r, err)
	}
	write := func(target string, body io.Reader) error {
		path, err := resolvePath(acct, target)
		if err != nil {
			return err
		}
		for _, prev := range out {
			if prev.Path == path {
				return badRequest("path %s is given more than once", path)
			}
		}
		u, err := e.writeUpload(path, body, acct, md)
		if err != nil {
			return err
		}
		undo = append(undo, u)
		out = append(out, envdWriteInfo{Path: path, Name: filepath.Base(path), Type: "file", Metadata: md})
		return nil
	}
	ctype, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if ctype == "multipart/form-data" {
		mr := multipart.NewReader(r.Body, params["boundary"])
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				fail(http.StatusBadRequest, "read multipart body: %v", err)
				return
			}
			if part.FormName() != "file" {
				continue
			}
			target := qpath
			if target == "" {
				target = partFilename(part)
			}
			if target == "" {
				fail(http.StatusBadRequest, "a file part has no path: give ?path= or the part's filename")
				return
			}
			if err := write(target, part); err != nil {
				failErr(err)
				return
			}
		}
	} else {
		if qpath == "" {
			envdError(w, http.StatusBadRequest, "path is required for a raw upload")
			return
		}
		var body io.Reader = r.Body
		switch enc := strings.ToLower(r.Header.Get("Content-Encoding")); enc {
		case "", "identity":
		case "gzip":
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				envdError(w, http.StatusBadRequest, "gzip body: %v", err)
				return
			}
			defer zr.Close()
			body = zr
		default:
			envdError(w, http.StatusUnsupportedMediaType, "unsupported Content-Encoding %q", enc)
			return
		}
		if err := write(qpath, body); err != nil {
			failErr(err)
			return
		}
	}
	if len(out) == 0 {
		envdError(w, http.StatusBadRequest, "the request holds no file (multipart parts must be named \"file\")")
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// writeUpload writes body to the file at path (keeping the mode of an existing file,
// 0644 otherwise), owned by acct, creating missing parents, and sets its metadata
// when md has some. On failure it removes what it created (the file if it was new,
// the parents it made); undo does the same after a later failure of the request.
func (e *envd) writeUpload(path string, body io.Reader, acct account, md map[string]string) (undo func(), err error) {
	mode := os.FileMode(0o644)
	existed := false
	if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() == fs.ModeSymlink {
		if target, err := filepath.EvalSymlinks(path); err == nil {
			path = target
		} else {
			// A link that leads nowhere yet: the write creates its target, as a plain
			// open would. The link is not ours to remove on failure.
			existed = true
		}
	}
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return nil, &apiError{status: http.StatusBadRequest, code: wire.ErrCodeIsDir, msg: path + " is a directory"}
		}
		mode = fi.Mode() & (fs.ModePerm | os.ModeSetuid | os.ModeSetgid | os.ModeSticky)
		existed = true
	}
	dirs, err := makeDirs(filepath.Dir(path), acct)
	if err != nil {
		return nil, err
	}
	cleanup := func() {
		if !existed {
			_ = os.Remove(path)
			_ = e.a.meta.forget(path, false)
		}
		removeDirs(dirs)
	}
	defer func() {
		if err != nil {
			cleanup()
		}
	}()
	// Written in place, as envd does: a watcher of the directory sees the file's own
	// create and write events, not a temporary file renamed over it.
	flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if !existed {
		flags |= os.O_EXCL // a file that appears meanwhile is not ours to remove
	}
	f, err := os.OpenFile(path, flags, mode)
	if err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	if err := chownTo(path, acct); err != nil {
		f.Close()
		return nil, err
	}
	_, err = io.CopyBuffer(writerOnly{f}, body, make([]byte, copyBuf))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	if len(md) > 0 {
		if err := e.a.meta.set(path, md); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return cleanup, nil
}
