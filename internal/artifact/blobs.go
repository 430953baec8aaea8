package artifact

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"

	"github.com/spacedev/space/internal/fault"
)

// A stream (a btrfs send stream, a checkpoint tar) travels as a sequence of blobs: the
// stream is cut into chunks of ChunkSize bytes, each compressed with zstd on its own and
// stored as one blob, named in the manifest in order. Chunks are what make uploads
// resumable (a blob the repository has already is not sent again: an interrupted push
// re-sends only the chunks it had not finished) and what a pull verifies before it uses
// a byte: each blob is downloaded whole, checked against its digest and size, and only
// then decompressed into the receiver. The streams space produces are deterministic
// (the same subvolume sends the same bytes; one zstd encoder at a fixed level compresses
// them to the same blobs), so a retried push names the same blobs.

// streamRecord is a stream as pushed: its blobs in order and its length.
type streamRecord struct {
	Layers []v1.Descriptor
	Bytes  int64 // uncompressed
}

// encoder and decoder options: fixed, so that equal chunks compress to equal blobs.
var (
	encOpts = []zstd.EOption{zstd.WithEncoderLevel(zstd.SpeedDefault)}
	decOpts = []zstd.DOption{zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(uint64(maxChunkSize))}
)

// pushStream uploads what produce writes, as blobs of media type mt annotated with part.
func (o *op) pushStream(ctx context.Context, p *remote.Pusher, repo name.Repository, part string, mt types.MediaType,
	produce func(ctx context.Context, w io.Writer) error) (streamRecord, error) {
	c := o.c
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	pr, pw := io.Pipe()
	prodErr := make(chan error, 1)
	go func() {
		err := produce(ctx, pw)
		pw.CloseWithError(err)
		prodErr <- err
	}()

	enc, err := zstd.NewWriter(nil, append(encOpts, zstd.WithEncoderConcurrency(min(c.jobs, runtime.GOMAXPROCS(0))))...)
	if err != nil {
		cancel(err)
		pr.CloseWithError(err)
		<-prodErr
		return streamRecord{}, err
	}
	defer enc.Close()
	var (
		mu     sync.Mutex
		layers []v1.Descriptor
		total  int64
		wg     sync.WaitGroup
	)
	sem := make(chan struct{}, c.jobs)
	for i := 0; ; i++ {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		buf := make([]byte, c.chunk)
		n, rerr := io.ReadFull(pr, buf)
		if n == 0 {
			<-sem
		} else {
			data := buf[:n]
			total += int64(n)
			mu.Lock()
			layers = append(layers, v1.Descriptor{})
			mu.Unlock()
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				defer func() { <-sem }()
				blob := enc.EncodeAll(data, make([]byte, 0, len(data)/2))
				sum := sha256.Sum256(blob)
				desc := v1.Descriptor{
					MediaType: mt,
					Size:      int64(len(blob)),
					Digest:    v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(sum[:])},
					Annotations: map[string]string{
						annPart: part,
						annSize: strconv.Itoa(len(data)),
					},
				}
				if err := p.Upload(ctx, repo, static.NewLayer(blob, mt)); err != nil {
					cancel(c.fail(ctx, fmt.Sprintf("upload %s chunk %d", part, i), err))
					return
				}
				mu.Lock()
				layers[i] = desc
				mu.Unlock()
			}(i)
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			// The producer failed (its error comes through the pipe), or was stopped
			// because an upload failed (then the cause says why).
			cancel(fmt.Errorf("%s: %w", part, rerr))
			break
		}
	}
	wg.Wait()
	pr.CloseWithError(errors.New("push ended"))
	perr := <-prodErr
	if cause := context.Cause(ctx); cause != nil {
		return streamRecord{}, cause
	}
	if perr != nil {
		return streamRecord{}, fmt.Errorf("%s: %w", part, perr)
	}
	return streamRecord{Layers: layers, Bytes: total}, nil
}

// uploadBlob uploads one small blob (a config) and returns its descriptor.
func (o *op) uploadBlob(ctx context.Context, p *remote.Pusher, repo name.Repository, mt types.MediaType, data []byte) (v1.Descriptor, error) {
	l := static.NewLayer(data, mt)
	d, err := l.Digest()
	if err != nil {
		return v1.Descriptor{}, err
	}
	if err := p.Upload(ctx, repo, l); err != nil {
		return v1.Descriptor{}, o.c.fail(ctx, "upload config", err)
	}
	return v1.Descriptor{MediaType: mt, Size: int64(len(data)), Digest: d}, nil
}

// rawManifest is a manifest to put as it is.
type rawManifest struct {
	b  []byte
	mt types.MediaType
}

func (m rawManifest) RawManifest() ([]byte, error)        { return m.b, nil }
func (m rawManifest) MediaType() (types.MediaType, error) { return m.mt, nil }

// fetchBlob downloads one blob whole and verifies its size and digest.
func (o *op) fetchBlob(ctx context.Context, p *remote.Puller, repo name.Repository, d v1.Descriptor) ([]byte, error) {
	c := o.c
	if d.Size < 0 || d.Size > maxChunkSize+(maxChunkSize>>4) {
		return nil, fault.New(fault.BadGateway, "registry %s: blob %s of %d bytes is out of bounds", c.registry, d.Digest, d.Size)
	}
	if d.Digest.Algorithm != "sha256" {
		return nil, fault.New(fault.BadGateway, "registry %s: blob digest %s is not sha256", c.registry, d.Digest)
	}
	l, err := p.Layer(ctx, repo.Digest(d.Digest.String()))
	if err != nil {
		return nil, c.fail(ctx, "fetch blob "+d.Digest.String(), err)
	}
	rc, err := l.Compressed()
	if err != nil {
		return nil, c.fail(ctx, "fetch blob "+d.Digest.String(), err)
	}
	defer rc.Close()
	var buf bytes.Buffer
	buf.Grow(int(d.Size))
	// go-containerregistry verifies the digest at the end of the body too (its error is
	// left to the check below, which names the blob); checking here, on bytes held in
	// memory, keeps the order "verify, then use" explicit.
	n, err := io.Copy(&buf, io.LimitReader(rc, d.Size+1))
	c.stats.bytesDown.Add(n)
	o.downloaded.Add(n)
	if err != nil && !isDigestError(err) {
		return nil, c.fail(ctx, "fetch blob "+d.Digest.String(), err)
	}
	sum := sha256.Sum256(buf.Bytes())
	if int64(buf.Len()) != d.Size || hex.EncodeToString(sum[:]) != d.Digest.Hex {
		return nil, fault.New(fault.BadGateway, "registry %s served blob %s with other content (%d bytes, sha256:%x): refused",
			c.registry, d.Digest, buf.Len(), sum)
	}
	c.stats.blobsDown.Add(1)
	return buf.Bytes(), nil
}

// isDigestError reports whether err is go-containerregistry's verification failure
// (pkg/v1/internal/verify reports size and digest mismatches so).
func isDigestError(err error) bool {
	return strings.Contains(err.Error(), "error verifying")
}

// chunkSize returns the declared uncompressed size of a chunk blob.
func chunkSize(d v1.Descriptor) (int64, error) {
	n, err := strconv.ParseInt(d.Annotations[annSize], 10, 64)
	if err != nil || n < 1 || n > maxChunkSize {
		return 0, fmt.Errorf("blob %s declares no valid uncompressed size", d.Digest)
	}
	return n, nil
}

// pullStream writes the decompressed concatenation of blobs to w. Up to Jobs blobs are
// downloaded ahead; each is verified before any of it is decompressed, and must
// decompress to exactly its declared size.
func (o *op) pullStream(ctx context.Context, p *remote.Puller, repo name.Repository, blobs []v1.Descriptor, w io.Writer) error {
	c := o.c
	sizes := make([]int64, len(blobs))
	for i, d := range blobs {
		n, err := chunkSize(d)
		if err != nil {
			return fault.New(fault.BadGateway, "registry %s: %v", c.registry, err)
		}
		sizes[i] = n
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		data []byte
		err  error
	}
	results := make([]chan result, len(blobs))
	for i := range results {
		results[i] = make(chan result, 1)
	}
	sem := make(chan struct{}, c.jobs)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i, d := range blobs {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				data, err := o.fetchBlob(ctx, p, repo, d)
				results[i] <- result{data, err}
			}()
		}
	}()
	defer wg.Wait()
	defer cancel()

	dec, err := zstd.NewReader(nil, decOpts...)
	if err != nil {
		return err
	}
	defer dec.Close()
	for i := range blobs {
		var r result
		select {
		case r = <-results[i]:
		case <-ctx.Done():
			return ctx.Err()
		}
		if r.err != nil {
			return r.err
		}
		if err := dec.Reset(bytes.NewReader(r.data)); err != nil {
			return fault.New(fault.BadGateway, "registry %s: blob %s: %v", c.registry, blobs[i].Digest, err)
		}
		n, err := io.Copy(destWriter{w}, io.LimitReader(dec, sizes[i]+1))
		if err != nil {
			var we *writeError
			if errors.As(err, &we) {
				return we.err
			}
			return fault.New(fault.BadGateway, "registry %s: blob %s does not decompress: %v", c.registry, blobs[i].Digest, err)
		}
		if n != sizes[i] {
			return fault.New(fault.BadGateway, "registry %s: blob %s decompresses to %d bytes, not the declared %d", c.registry, blobs[i].Digest, n, sizes[i])
		}
		<-sem
	}
	return nil
}

// writeError marks an error of the destination, not of the stream, in pullStream.
type writeError struct{ err error }

func (e *writeError) Error() string { return e.err.Error() }

// destWriter wraps w so that pullStream tells its failures from the source's.
type destWriter struct{ w io.Writer }

func (d destWriter) Write(p []byte) (int, error) {
	n, err := d.w.Write(p)
	if err != nil {
		err = &writeError{err}
	}
	return n, err
}
