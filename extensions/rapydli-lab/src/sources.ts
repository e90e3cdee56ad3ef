/** The run view's Source section: the code a run names, as it was recorded or as its module has it. */
import { ISource } from './api';
import { h } from './format';

/** Sources longer than this many lines start collapsed. */
const OPEN_LINES = 40;

/** The heading of one source: what it is and where it comes from. */
function describe(source: ISource): string {
  if (source.origin === 'notebook') {
    return `${source.name} · defined in the notebook`;
  }
  const where = source.file ? ` · ${source.file.split('/').slice(-2).join('/')}:${source.line}` : '';
  return `${source.role ?? source.name}: ${source.ref ?? source.name}${where}`;
}

/**
 * One collapsible block per source (monospace, newlines kept): the notebook's own code opens,
 * as does short module code; null when the run names no code.
 */
export function sourceSection(sources: ISource[]): HTMLElement | null {
  if (sources.length === 0) {
    return null;
  }
  const section = h('section', { className: 'rapydli-Sources', attrs: { 'aria-label': 'Source' } }, [h('h2', { text: 'Source' })]);
  for (const source of sources) {
    const lines = source.source.replace(/\n$/, '').split('\n').length;
    const block = h('details', { className: 'rapydli-Source', attrs: { 'data-origin': source.origin, 'data-name': source.name } }, [
      h('summary', {
        text: describe(source),
        attrs: { title: source.file ? `${source.file}, line ${source.line}` : `${source.name}, recorded when the run started` }
      }),
      h('pre', { className: 'rapydli-Code', attrs: { 'aria-label': `Source of ${source.name}` } }, [h('code', { text: source.source })])
    ]);
    block.open = source.origin === 'notebook' || lines <= OPEN_LINES;
    section.append(block);
  }
  return section;
}
