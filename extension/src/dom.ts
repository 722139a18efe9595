/**
 * A tiny element builder: the panel is plain DOM, so the bundle stays small.
 */
export interface IElementOptions {
  className?: string;
  text?: string;
  attrs?: Record<string, string>;
}

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  options: IElementOptions = {},
  children: Node[] = []
): HTMLElementTagNameMap[K] {
  const element = document.createElement(tag);
  if (options.className) {
    element.className = options.className;
  }
  if (options.text !== undefined) {
    element.textContent = options.text;
  }
  for (const [name, value] of Object.entries(options.attrs ?? {})) {
    element.setAttribute(name, value);
  }
  element.append(...children);
  return element;
}

/** Show a message in a status line, styled as an error or as a plain note. */
export function setStatus(
  node: HTMLElement,
  message: string,
  kind: 'error' | 'note' | 'warning' = 'note'
): void {
  node.textContent = message;
  node.hidden = message === '';
  node.dataset.kind = kind;
  node.setAttribute('role', kind === 'note' ? 'status' : 'alert');
}
